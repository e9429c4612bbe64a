"""The run spec: everything a run's process builds and records, typed.

Built and validated once in the parent (:func:`contract_lib.runs.harness.run`), keyed by
the frame cache (:meth:`RunSpec.identity`), sent to the run's process as JSON (a warm
server's fork or a cold interpreter alike, :mod:`contract_lib.wire.framing`) and read
there by attribute (:func:`contract_lib.child.main.child_run`). The loop travels as its
whole :class:`~contract_lib.loops.LoopSpec`, so a loop registered in the parent reaches
a child forked from a server that never saw it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from contract_lib.loops import LoopSpec
from contract_lib.workloads import Workload

# ``model-free``: every loop's forward is a deterministic next-token function
# (:mod:`contract_lib.child.shims`). ``real`` (MLX loops only): SGLang's own
# ``MlxModelRunner`` runs the tiny mlx-lm model of :mod:`contract_lib.sources.tiny_model`
# on MLX's CPU backend, so its KV pool syncs and radix reads are real.
MODEL_FREE, REAL = "model-free", "real"
RUNNERS = (MODEL_FREE, REAL)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run: what to build, feed and record, and where its process finds it."""

    workload: Workload
    loop: LoopSpec
    patch: str | None = None  # a PatchSpec's text: patches joined with "+", in order
    server_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # the caller's
    runner: str = MODEL_FREE  # MLX loops: the model-free runner or SGLang's real one
    capture: bool = True  # False: only the run's fate and timing (the capture's baseline)
    audit: bool = False  # also every write to the contract's objects (``effects``)
    sglang: str | None = None  # the SGLang version the run must import
    sglang_source: dict[str, Any] | None = None  # a source tree's or diff copy's identity
    omni: dict[str, Any] | None = None  # loop omni: sglang-omni's version and install stamp
    # Where the run's process finds them (not part of the identity: the above are).
    sglang_dir: str | None = None  # the folder put first on its path (None: the venv's)
    omni_dir: str | None = None
    model_dir: str | None = None  # the real runner's model folder

    def identity(self) -> dict[str, Any]:
        """Everything that shapes the run, as plain data (the frame cache's key hashes it
        with the files the run imports)."""
        whole = self.to_json()
        return {name: value for name, value in whole.items()
                if name not in ("sglang_dir", "omni_dir", "model_dir")}

    def user_server_args(self) -> dict[str, Any]:
        """The server args the workload and the caller set (the base ones are known good)."""
        return {**self.workload.server_args, **self.server_args}

    def to_json(self) -> dict[str, Any]:
        """Plain data for the wire (JSON types only)."""
        return {**dataclasses.asdict(self), "workload": self.workload.to_dict(),
                "loop": dataclasses.asdict(self.loop)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "RunSpec":
        """A spec from :meth:`to_json`'s data (the parent validated its workload)."""
        return cls(**{**raw, "workload": Workload.from_dict(raw["workload"], validate=False),
                      "loop": LoopSpec(**raw["loop"])})
