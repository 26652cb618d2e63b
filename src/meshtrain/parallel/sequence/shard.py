"""Which tokens a sequence-parallel rank holds: the layout each attention module expects.

- ``"ulysses"``: contiguous chunks, rank i holds chunk i of sp.
- ``"ring"``: the load-balanced "zigzag" layout, rank i holds chunks i and 2*sp-1-i of 2*sp
  (:func:`zigzag_chunks`), so that under a causal mask every rank has the same amount of work.
- ``"usp"``: ring's zigzag over the R = sp/U ring ranks, each chunk cut further into U contiguous pieces: sp rank
  k = r*U + u (ring rank r, Ulysses rank u) holds piece u of chunks r and 2R-1-r of 2R (:func:`usp_pieces`). After
  USP's all-to-all over the U ranks of ring rank r, they hold chunks r and 2R-1-r whole, as ring attention expects.

:func:`shard_sequence` cuts a tensor (token ids, targets) to this rank's tokens and
:func:`sequence_positions` gives their global positions, both in the order the rank holds them.
"""

from __future__ import annotations

import torch

from meshtrain.axes import SP_MODES


def shard_sequence(x: torch.Tensor, dim: int, sp_rank: int, sp: int, mode: str, ulysses: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim``: length T -> T/sp.

    - ``"ulysses"``: the contiguous chunk ``sp_rank`` of ``sp``.
    - ``"ring"``: zigzag: the sequence is cut into 2*sp chunks and rank i holds chunks i and
      2*sp-1-i, concatenated; under a causal mask every rank then has the same amount of work
      (the causal load-balancing problem of Brandon et al. 2023, arXiv:2311.09431, solved as in
      Llama 3's context parallelism, arXiv:2407.21783, Sec. 3.3.2).
    - ``"usp"`` (``ulysses`` = U, the Ulysses degree; USP, Fang and Zhao 2024, arXiv:2405.07719, with ring's
      load-balanced zigzag): the sequence is cut into 2*sp pieces, chunk c of ring's 2R (R = sp/U) being pieces
      c*U .. c*U+U-1; sp rank k = r*U + u holds pieces r*U+u and (2R-1-r)*U+u, concatenated. ``ulysses = 1`` is
      ring's layout; ``ulysses = sp`` (one ring rank) holds piece k of each half, pieces k and sp+k.

    Raises:
        ValueError: unknown ``mode``, ``sp_rank`` outside [0, sp), ``ulysses`` not a divisor of sp ("usp"), or
            the length is not divisible by sp ("ulysses") or 2*sp ("ring", "usp").
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
    first, second = zigzag_chunks(sp_rank, sp) if mode == "ring" else usp_pieces(sp_rank, sp, ulysses)
    return torch.cat([chunks[first], chunks[second]], dim)  # (..., T/sp, ...)


def sequence_positions(seq_len: int, sp_rank: int, sp: int, mode: str,
                       device: torch.device | str | None = None, ulysses: int = 1) -> torch.Tensor:
    """LongTensor (seq_len/sp,): global positions of this rank's tokens, in local order (as :func:`shard_sequence`)."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, sp_rank, sp, mode, ulysses)


def zigzag_chunks(sp_rank: int, sp: int) -> tuple[int, int]:
    """Global chunk indices (of 2*sp) that group rank ``sp_rank`` holds in the "ring" layout."""
    return sp_rank, 2 * sp - 1 - sp_rank


def usp_pieces(sp_rank: int, sp: int, ulysses: int) -> tuple[int, int]:
    """Global piece indices (of 2*sp) that sp rank ``sp_rank`` = r*U + u holds in the "usp" layout (U = ``ulysses``):
    piece u of ring chunks r and 2R-1-r (R = sp/U), i.e. pieces r*U + u and (2R-1-r)*U + u.

    Raises:
        ValueError: ``ulysses`` is not a divisor of ``sp``.
    """
    if ulysses < 1 or sp % ulysses:
        raise ValueError(f"sp_ulysses = {ulysses} does not divide sp = {sp}: USP splits sp into sp_ulysses x "
                         f"sp/sp_ulysses ranks")
    ring_rank, u = divmod(sp_rank, ulysses)
    first, second = zigzag_chunks(ring_rank, sp // ulysses)
    return first * ulysses + u, second * ulysses + u
