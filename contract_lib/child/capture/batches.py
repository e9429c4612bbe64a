"""Reading SGLang's batches and allocator: small pure helpers the recorders share."""

from __future__ import annotations

import numpy as np

from contract_lib.sources.compat import free_pages


def mode_name(batch) -> str | None:
    if batch is None or batch.is_empty():
        return None
    return batch.forward_mode.name.lower()


class NumpyView:
    """The numpy view of one long-lived CPU tensor (``req_to_token``, the relay buffer),
    made again only when the tensor object, its storage address or its shape changed:
    ``Tensor.numpy()`` costs ~10 µs inside a running loop (cold caches), and the
    recorder reads these tensors several times a step."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._tensor = None  # held, so its id cannot be reused by another tensor
        self._array: np.ndarray | None = None

    def of(self, tensor) -> np.ndarray:
        key = (id(tensor), tensor.data_ptr(), tensor.shape)
        if key != self._key:
            self._tensor, self._array, self._key = tensor, tensor.numpy(), key
        return self._array


def tolist(tensor) -> list:
    return [] if tensor is None else tensor.tolist()


def length(sequence) -> int:
    """``len(sequence)``, read off the first dimension where it has one: a tensor's
    ``__len__`` is Python code (~1.5 µs inside a running loop), its shape a tuple."""
    shape = getattr(sequence, "shape", None)
    return shape[0] if shape else len(sequence)


def prefill_lanes(batch) -> list[int]:
    """Indices into ``batch.reqs`` of its prefill/extend lanes: every request of an
    extend or mixed batch except its decode lanes (``decoding_reqs``); none of a decode
    batch."""
    if batch is None or batch.is_empty() or not batch.forward_mode.is_extend():
        return []
    decoding = {id(req) for req in (batch.decoding_reqs or ())}
    return [i for i, req in enumerate(batch.reqs) if id(req) not in decoding]


def prefilled_tokens(batch, lanes: list[int] | None = None) -> int:
    """Tokens a launch prefills (clause 6): its prefill lanes' ``extend_lens``; a decode
    lane of a mixed batch, a decode or a chained launch (``batch`` None) prefill none.
    ``lanes``: the batch's :func:`prefill_lanes`, where the caller has them."""
    if lanes is None:
        lanes = prefill_lanes(batch)
    return int(sum(batch.extend_lens[i] for i in lanes))


def free_slot_mask(allocator) -> np.ndarray:
    """A mask over slot ids: True where the allocator holds the slot as free (its free
    pages, released or staged ones included, as SGLang's own census
    ``get_all_free_pages`` lists them, :func:`contract_lib.sources.compat.free_pages`; a page is
    ``page_size`` slots, page 0 reserved)."""
    page = allocator.page_size
    mask = np.zeros(allocator.size // page + 1, dtype=bool)
    mask[free_pages(allocator).numpy()] = True
    return mask if page == 1 else np.repeat(mask, page)
