"""A tiny random-weight Llama that mlx-lm builds locally, for the real MLX runner.

``runner="real"`` runs SGLang's own ``MlxModelRunner``, which loads an mlx-lm model.
Nothing is downloaded: :func:`build_tiny_model` initialises mlx-lm's own ``llama.Model``
from a fixed seed and writes a checkpoint folder that mlx-lm, transformers and SGLang's
``ModelConfig`` read offline:

- ``config.json``: the 2-layer, 64-wide Llama of ``data/model/config.json`` (4 heads,
  2 KV heads, vocab 512, eos 2);
- ``model.safetensors``: float32 weights (bit-stable logits on MLX's CPU backend); the
  output head is scaled so greedy tokens vary, and its rows 0..9 are zero, so greedy
  decoding never emits EOS or another special id (as the model-free next-token function,
  whose tokens start at ``FIRST_ORDINARY_TOKEN = 10``): a run lasts exactly
  ``max_new_tokens`` per request;
- a WordLevel ``tokenizers`` tokenizer over the 512 ids (``tokenizer.json`` and its
  config), which mlx-lm's loader requires.

The same seed writes byte-identical weights. :func:`tiny_model_dir` builds the model once
into ``.cache/tiny-llama-seed<seed>`` (atomically) and returns the folder.
:func:`reference_outputs` is mlx-lm's own greedy generation on that model (its own KV
cache, no SGLang): what a correct serving stack must emit for a workload.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from contract_lib.paths import PROJECT_ROOT
from contract_lib.workloads import FIRST_ORDINARY_TOKEN, Workload, load_workload

DEFAULT_SEED = 0

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}

# Output-head rows zeroed: the ids below FIRST_ORDINARY_TOKEN never win the greedy argmax.
_SPECIAL = {"unk": "<unk>", "bos": "<s>", "eos": "</s>"}
_BUILD_LOCK = threading.Lock()


def _vocab() -> dict[str, int]:
    vocab = {_SPECIAL["unk"]: 0, _SPECIAL["bos"]: 1, _SPECIAL["eos"]: 2}
    for i in range(3, CONFIG["vocab_size"]):
        vocab[f"t{i}"] = i
    return vocab


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token=_SPECIAL["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(list(_SPECIAL.values()))
    tokenizer.save(str(path / "tokenizer.json"))
    special = {"bos_token": _SPECIAL["bos"], "eos_token": _SPECIAL["eos"],
               "unk_token": _SPECIAL["unk"], "pad_token": _SPECIAL["unk"]}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **special,
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=1))


def build_tiny_model(path: str | Path, seed: int = DEFAULT_SEED) -> Path:
    """Write the tiny checkpoint into ``path`` (created; existing files overwritten)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=1))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    weights = dict(tree_flatten(model.parameters()))
    # nn.Linear's default init gives logits with a tiny spread; scaling the head keeps
    # the greedy argmax clear of near-ties, so tokens vary and are stable.
    head = weights["lm_head.weight"] * 8.0
    row = mx.arange(head.shape[0])[:, None]
    weights["lm_head.weight"] = mx.where(row < FIRST_ORDINARY_TOKEN, 0.0, head)
    weights = {name: value.astype(mx.float32) for name, value in weights.items()}
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights,
                        metadata={"format": "mlx"})
    _write_tokenizer(path)
    return path


def model_cache_root() -> Path:
    """Where built models live: ``.cache`` of the project checkout (beside ``frames``)."""
    return PROJECT_ROOT / ".cache"


def tiny_model_dir(seed: int = DEFAULT_SEED) -> Path:
    """The tiny model's folder, built on first use (~1 s, ~0.6 MB).

    Atomic: built in a temporary sibling folder, renamed into place when complete; a
    concurrent builder that loses the rename discards its copy.
    """
    target = model_cache_root() / f"tiny-llama-seed{seed}"
    if (target / "model.safetensors").is_file():
        return target
    with _BUILD_LOCK:
        if (target / "model.safetensors").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_model(tmp, seed=seed)
        try:
            os.rename(tmp, target)
        except OSError:  # another process renamed its copy first
            shutil.rmtree(tmp, ignore_errors=True)
            if not (target / "model.safetensors").is_file():
                raise
    return target


def weights_digest(path: str | Path) -> str:
    """sha256 of ``model.safetensors`` (first 16 hex digits)."""
    return hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()[:16]


def load_reference_model(path: str | Path | None = None):
    """mlx-lm's own model for the tiny checkpoint (unpatched: plain mlx-lm attention)."""
    from mlx_lm import load

    model, _tokenizer = load(str(path or tiny_model_dir()))
    return model


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """mlx-lm greedy decoding with its own KV cache: ``steps`` tokens after ``prompt``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt], dtype=mx.int32), cache=cache)
    out = [int(mx.argmax(logits[0, -1]).item())]
    while len(out) < steps:
        logits = model(mx.array([[out[-1]]], dtype=mx.int32), cache=cache)
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out


def reference_kv(model, tokens: list[int]) -> list[tuple[Any, Any]]:
    """mlx-lm's K and V of ``tokens``, per layer: ``(n_kv_heads, len, head_dim)`` each."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([tokens], dtype=mx.int32), cache=cache)
    layers = [(c.keys[0, :, :len(tokens), :], c.values[0, :, :len(tokens), :])
              for c in cache]
    mx.eval(layers)
    return layers


def reference_outputs(workload: str | Workload, model_dir: str | Path | None = None,
                      ) -> dict[str, list[int]]:
    """mlx-lm greedy tokens per request of ``workload`` on the tiny model.

    A later turn (``turn_of = "X"``) gets the prompt the harness gives it: X's prompt,
    X's reference output, its own tokens. Arrival times and batching play no part: this
    is what every request must emit when the serving stack computes the right KV.
    """
    if not isinstance(workload, Workload):
        workload = load_workload(workload)
    model = load_reference_model(model_dir)
    prompts: dict[str, list[int]] = {}
    out: dict[str, list[int]] = {}
    for spec in workload.requests:
        prompt = list(spec.prompt)
        if spec.turn_of is not None:
            prompt = prompts[spec.turn_of] + out[spec.turn_of] + prompt
        prompts[spec.rid] = prompt
        out[spec.rid] = greedy(model, prompt, spec.max_new_tokens)
    return out
