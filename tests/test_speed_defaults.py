"""The fast defaults (docs/training.md, "Fast by default"): ``train.dtype = auto``, ``train.compile``,
``optim.fused``, and the foreach gradient-norm clipping. Each must change speed only: the arithmetic
stays what the explicit fp32 / uncompiled / for-loop settings compute, up to rounding."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import CONFIG, TINY, assert_close_losses, losses, train_here


def test_auto_dtype_is_bf16_exactly_where_matmuls_have_bf16_hardware():
    from meshtrain.runtime.device import compute_dtype

    cpu_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # AVX512-BF16 / AMX: oneDNN's bf16 GEMMs
    assert compute_dtype("auto", "cpu") == ("bfloat16" if cpu_bf16 else "float32")
    assert compute_dtype("float32", "cpu") == "float32" and compute_dtype("bfloat16", "cpu") == "bfloat16"
    if torch.cuda.is_available():
        assert compute_dtype("auto", "cuda") == ("bfloat16" if torch.cuda.is_bf16_supported() else "float32")


def test_a_run_records_the_dtype_auto_picked_and_its_arithmetic(tmp_path):
    from meshtrain.runtime.device import compute_dtype

    auto = losses(train_here(tmp_path / "auto", **{"train.dtype": "auto", "train.steps": "3"}))
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert summary["dtype"] == compute_dtype("auto", "cpu") and summary["compiled"] is False  # auto: CPU uncompiled
    explicit = losses(train_here(tmp_path / "explicit", **{"train.dtype": summary["dtype"], "train.steps": "3"}))
    assert auto == explicit  # the same dtype, the same operations in the same order: bit-identical


def test_bf16_attention_on_the_cpu_runs_the_fp32_kernel_under_autocast():
    """causal_attention of bf16 q, k, v under CPU bf16 autocast is the fp32 kernel on the same values,
    cast back: bitwise the same arithmetic, so equality is exact. Without switching autocast off inside,
    autocast would cast the fp32 copies back to bf16 and run the bf16 kernel (different rounding)."""
    import torch.nn.functional as F

    from meshtrain.models.attention import causal_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8).bfloat16().requires_grad_() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = causal_attention(q, k, v)
    y.float().square().sum().backward()
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, expected)
    native = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.equal(native, expected)  # the bf16 kernel rounds differently: the check above can fail
    assert q.grad is not None and q.grad.dtype == torch.bfloat16


def test_fused_adamw_is_chosen_for_plain_tensors_unless_turned_off():
    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model
    from meshtrain.optim.build import build_optimizer

    model = build_model(load_config(CONFIG, TINY).model, 65)
    fused, _ = build_optimizer(model.named_parameters(), load_config(CONFIG, TINY), 12)
    loop, _ = build_optimizer(model.named_parameters(), load_config(CONFIG, {**TINY, "optim.fused": "false"}), 12)
    assert fused.defaults["fused"] is True and not loop.defaults["fused"]


def test_fused_adamw_trains_as_the_for_loop_does(tmp_path):
    fused = losses(train_here(tmp_path / "fused", **{"optim.fused": "true"}))
    loop = losses(train_here(tmp_path / "loop", **{"optim.fused": "false"}))
    # The fused kernel computes AdamW's update with the same formula in another operation order: each
    # parameter differs by a few ulps per step, which conftest's 1e-5 on the losses covers (its docstring).
    assert_close_losses(fused, loop)


def test_clipping_matches_torch_clip_grad_norm():
    from meshtrain.parallel.reduce import clip_grad_norm_

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 4096)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape) * 3
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, 1.0)
    want = float(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    # Both sum 4403 squares in fp32 (ours per tensor in fp32, then the squares of 3 norms in fp64): the
    # relative rounding of such sums is <= log2(4403) * 2**-24 ~ 7e-7 each; 2e-6 covers both.
    assert norm == pytest.approx(want, rel=2e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=0)  # scaled by the same coefficient


@pytest.mark.slow  # inductor compiles the blocks on 2 cores (27-38 s): `make test` stays under 15 min on AVX2 machines
def test_compiled_blocks_train_as_the_eager_ones(tmp_path):
    eager = losses(train_here(tmp_path / "eager", **{"train.compile": "off"}))
    compiled = losses(train_here(tmp_path / "compiled", **{"train.compile": "on"}))
    assert json.loads((tmp_path / "compiled" / "summary.json").read_text())["compiled"] is True
    # Inductor fuses each block's elementwise work (GELU, residual adds, layer norm) into loops that round
    # in another order; the matmuls stay oneDNN's. Per-op differences are a few ulps, as for a layout's
    # reordered sums, so docs/architecture.md's 1e-5 applies (conftest.assert_close_losses).
    assert_close_losses(compiled, eager)


@pytest.mark.slow  # a parameter-server launch, ~10 s: `make test-slow` keeps `make test` under 15 min
def test_async_workers_train_in_the_dtype_asked_for(tmp_path):
    """One server and one worker: each gradient is computed on the parameters the previous one updated
    (the worker waits for the server's answer), so the run is the synchronous dp = 1 run, in its dtype."""
    from conftest import override_args, read_records, run_cli

    bf16 = {"train.dtype": "bfloat16", "train.steps": "3"}
    proc = run_cli("train", str(CONFIG), "--nproc", "2", "--out", str(tmp_path / "async"),
                   *override_args({**TINY, **bf16, "parallel.sync_mode": "async", "parameter_server.max_staleness": "1000"}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((tmp_path / "async" / "summary.json").read_text())["dtype"] == "bfloat16"
    sync_bf16 = losses(train_here(tmp_path / "sync_bf16", **bf16))
    sync_fp32 = losses(train_here(tmp_path / "sync_fp32", **{**bf16, "train.dtype": "float32"}))
    assert sync_bf16[1] != sync_fp32[1]  # bf16 logits round at 2**-9: the test can tell the dtypes apart
    # The same operations on the same batches; only the servers' AdamW step runs over the parameters as
    # one shard instead of the model's parameter list (the same fused kernel): docs/architecture.md's 1e-5 applies.
    assert_close_losses(losses(read_records(tmp_path / "async")), sync_bf16)


def test_fsdp2_wraps_the_units_that_fsdp_units_names():
    """The trainer's FSDP2 units are :func:`meshtrain.rules.support.fsdp_units`' (which the planner reads): one
    parameter group per unit, every unit but the last resharded after forward at zero_stage 3."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model
    from meshtrain.parallel.data_parallel import apply_dp, local_bytes
    from meshtrain.rules.support import fsdp_units

    cfg = load_config(CONFIG, {**TINY, "model.n_layer": "5"})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for unit_mb in (0.0, 0.06, 25.0):  # a unit per block; two blocks of 49.7 kB each; all in the root
            model = build_model(cfg.model, 65)
            blocks = list(model.blocks.values())
            units, rest = fsdp_units([local_bytes(b) for b in blocks], unit_mb * 2**20)
            apply_dp(model, mesh, 3, unit_mb)
            for i, unit in enumerate(units):
                groups = [blocks[j]._get_fsdp_state()._fsdp_param_group for j in unit]
                assert all(g is groups[0] for g in groups)  # one all-gather, one reduce-scatter per unit
                assert (groups[0].post_forward_mesh_info is None) == (i == len(units) - 1)
            assert not any(hasattr(blocks[j], "_get_fsdp_state") for j in rest)  # the root's parameters
            assert model._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None  # kept for backward
        assert (len(units), rest) == (0, [0, 1, 2, 3, 4])
    finally:
        dist.destroy_process_group()
