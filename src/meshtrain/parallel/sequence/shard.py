"""Which tokens a sequence-parallel rank holds: the layout each attention module expects.

- ``"ulysses"``: contiguous chunks, rank i holds chunk i of sp.
- ``"ring"``: the load-balanced "zigzag" layout, rank i holds chunks i and 2*sp-1-i of 2*sp
  (:func:`zigzag_chunks`), so that under a causal mask every rank has the same amount of work.

:func:`shard_sequence` cuts a tensor (token ids, targets) to this rank's tokens and
:func:`sequence_positions` gives their global positions, both in the order the rank holds them.
"""

from __future__ import annotations

import torch

from meshtrain.axes import SP_MODES


def shard_sequence(x: torch.Tensor, dim: int, sp_rank: int, sp: int, mode: str) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim``: length T -> T/sp.

    - ``"ulysses"``: the contiguous chunk ``sp_rank`` of ``sp``.
    - ``"ring"``: zigzag: the sequence is cut into 2*sp chunks and rank i holds chunks i and
      2*sp-1-i, concatenated; under a causal mask every rank then has the same amount of work
      (the causal load-balancing problem of Brandon et al. 2023, arXiv:2311.09431, solved as in
      Llama 3's context parallelism, arXiv:2407.21783, Sec. 3.3.2).

    Raises:
        ValueError: unknown ``mode``, ``sp_rank`` outside [0, sp), or the length is not divisible
            by sp ("ulysses") or 2*sp ("ring").
    """
    if mode not in SP_MODES:
        raise ValueError(f"sequence-parallel mode = {mode!r} is not known: use one of {SP_MODES}")
    if not 0 <= sp_rank < sp:
        raise ValueError(f"sp_rank = {sp_rank} is outside [0, sp = {sp})")
    n_chunks = sp if mode == "ulysses" else 2 * sp
    T = x.size(dim)
    if T % n_chunks:
        raise ValueError(f"sequence length {T} (tensor dim {dim}) is not divisible by {n_chunks}: "
                         f"mode {mode!r} with sp = {sp} cuts it into {n_chunks} equal chunks")
    chunks = x.chunk(n_chunks, dim)  # n_chunks x (..., T/n_chunks, ...)
    if mode == "ulysses":
        return chunks[sp_rank]
    first, second = zigzag_chunks(sp_rank, sp)
    return torch.cat([chunks[first], chunks[second]], dim)  # (..., T/sp, ...)


def sequence_positions(seq_len: int, sp_rank: int, sp: int, mode: str,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """LongTensor (seq_len/sp,): global positions of this rank's tokens, in local order (as :func:`shard_sequence`)."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, sp_rank, sp, mode)


def zigzag_chunks(sp_rank: int, sp: int) -> tuple[int, int]:
    """Global chunk indices (of 2*sp) that group rank ``sp_rank`` holds in the "ring" layout."""
    return sp_rank, 2 * sp - 1 - sp_rank
