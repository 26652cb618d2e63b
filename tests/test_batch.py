"""Batch arithmetic (meshtrain.batch_math) against the formulas and seed examples of docs/architecture.md."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from meshtrain.batch_math import data_parallel_size, open_sora_log, plan_batch, scaled_lr, steps_per_epoch
from meshtrain.errors import ConfigError

degree = st.integers(1, 8)
size = st.integers(1, 64)


# --- the worked examples (docs/architecture.md, "Terms") ---------------------------------------

def test_sp_seed_8_gpus_sp4_batch1_ga1_gives_2():
    plan = plan_batch(world_size=8, micro_batch_size=1, gradient_accumulation_steps=1, sp=4)
    assert (plan.dp, plan.global_batch_size) == (2, 2)


def test_sp_seed_8_gpus_sp2_batch2_gives_8():
    plan = plan_batch(world_size=8, micro_batch_size=2, sp=2)
    assert (plan.dp, plan.global_batch_size) == (4, 8)


def test_training_time_seed_1000_samples_batch_10_gives_100_steps():
    plan = plan_batch(world_size=1, micro_batch_size=10, num_samples=1000)
    assert plan.steps_per_epoch == 100
    assert plan.micro_steps_per_epoch == 100
    assert (plan.epochs, plan.total_steps) == (1.0, 100)


def test_training_time_seed_batch_5_ga_2_gives_200_micro_steps_and_100_updates():
    plan = plan_batch(world_size=1, micro_batch_size=5, gradient_accumulation_steps=2, num_samples=1000)
    assert plan.global_batch_size == 10
    assert plan.micro_steps_per_epoch == 200
    assert plan.steps_per_epoch == 100


def test_only_dp_multiplies_the_batch_not_nnodes_or_nproc():
    # The seed's "nnodes is PP and nproc_per_node is TP": 2 nodes x 4 ranks with pp=2, tp=4 is dp=1.
    plan = plan_batch(world_size=2 * 4, micro_batch_size=3, gradient_accumulation_steps=5, tp=4, pp=2)
    assert plan.dp == 1
    assert plan.global_batch_size == 3 * 5


# --- properties of the general form -----------------------------------------------------------------

@given(tp=degree, pp=degree, sp=degree, dp=degree, mbs=size, ga=size, seq_len=st.integers(1, 4096))
def test_global_batch_is_mbs_times_ga_times_dp(tp, pp, sp, dp, mbs, ga, seq_len):
    world = dp * tp * pp * sp
    plan = plan_batch(world, mbs, ga, tp=tp, pp=pp, sp=sp, seq_len=seq_len)
    assert plan.dp == dp
    assert plan.world_size == plan.dp * plan.tp * plan.pp * plan.sp
    assert plan.global_batch_size == mbs * ga * dp
    assert plan.tokens_per_step == plan.global_batch_size * seq_len


@given(tp=degree, pp=degree, sp=degree, world=st.integers(1, 512))
def test_world_not_divisible_by_tp_pp_sp_raises(tp, pp, sp, world):
    assume(world % (tp * pp * sp) != 0)
    with pytest.raises(ConfigError, match=f"world_size = {world} is not divisible"):
        data_parallel_size(world, tp=tp, pp=pp, sp=sp)


@pytest.mark.parametrize("kwargs, key", [
    (dict(world_size=0, micro_batch_size=1), "world_size = 0"),
    (dict(world_size=4, micro_batch_size=1, tp=0), "tp = 0"),
    (dict(world_size=4, micro_batch_size=1, pp=-2), "pp = -2"),
    (dict(world_size=4, micro_batch_size=1, sp=0), "sp = 0"),
    (dict(world_size=4, micro_batch_size=0), "micro_batch_size = 0"),
    (dict(world_size=4, micro_batch_size=-3), "micro_batch_size = -3"),
    (dict(world_size=4, micro_batch_size=1, gradient_accumulation_steps=0), "gradient_accumulation_steps = 0"),
    (dict(world_size=4, micro_batch_size=1, seq_len=0), "seq_len = 0"),
    (dict(world_size=4, micro_batch_size=1, num_samples=0), "num_samples = 0"),
    (dict(world_size=4, micro_batch_size=1, num_samples=10, epochs=0.0), "epochs = 0.0"),
    (dict(world_size=4, micro_batch_size=1, total_steps=0), "total_steps = 0"),
    (dict(world_size=4, micro_batch_size=1, time_per_step_s=-1.0), "time_per_step = -1.0"),
    (dict(world_size=4, micro_batch_size=1, num_samples=10, epochs=1.0, total_steps=5), "not both"),
    (dict(world_size=4, micro_batch_size=1, epochs=2.0), "epochs needs num_samples"),
])
def test_invalid_layout_raises_config_error_naming_the_value(kwargs, key):
    with pytest.raises(ConfigError) as err:
        plan_batch(**kwargs)
    assert key in str(err.value)
    assert "\n" not in str(err.value)


@given(num_samples=st.integers(1, 10**6), gbs=st.integers(1, 10**4))
def test_steps_per_epoch_is_ceil(num_samples, gbs):
    spe = steps_per_epoch(num_samples, gbs)
    assert (spe - 1) * gbs < num_samples <= spe * gbs  # the last step may be partial, never empty


def test_steps_per_epoch_rejects_empty_batch():
    with pytest.raises(ConfigError, match="global_batch_size = 0"):
        steps_per_epoch(100, 0)


@given(num_samples=st.integers(1, 10**6), mbs=size, dp=degree, ga=size, total_steps=st.integers(1, 10**5))
def test_epochs_total_steps_round_trip(num_samples, mbs, dp, ga, total_steps):
    by_steps = plan_batch(dp, mbs, ga, num_samples=num_samples, total_steps=total_steps)
    assert by_steps.epochs == pytest.approx(total_steps / by_steps.steps_per_epoch)
    by_epochs = plan_batch(dp, mbs, ga, num_samples=num_samples, epochs=by_steps.epochs)
    assert by_epochs.total_steps == total_steps


@pytest.mark.parametrize("epochs, spe, total", [(1.1, 100, 110), (2.2, 100, 220), (0.5, 3, 2), (1e-12, 7, 1)])
def test_fractional_epochs_round_up_to_whole_steps(epochs, spe, total):
    plan = plan_batch(1, 1, num_samples=spe, epochs=epochs)
    assert plan.total_steps == total


@given(total_steps=st.integers(1, 10**6), t=st.floats(1e-4, 1e4))
def test_total_time_is_steps_times_time_per_step(total_steps, t):
    plan = plan_batch(2, 3, total_steps=total_steps, time_per_step_s=t)
    assert plan.total_time_s == pytest.approx(total_steps * t)
    assert plan_batch(2, 3, total_steps=total_steps).total_time_s is None


def test_total_time_over_epochs_is_epochs_times_steps_per_epoch_times_time():
    plan = plan_batch(world_size=4, micro_batch_size=5, num_samples=1000, epochs=3, time_per_step_s=0.25)
    assert plan.steps_per_epoch == 50
    assert plan.total_time_s == pytest.approx(3 * 50 * 0.25)


# --- Open-Sora-Plan's logged numbers against the real ones (docs/architecture.md) ------------------------------

@st.composite
def open_sora_layout(draw):
    sp, dp, b = draw(degree), draw(degree), draw(st.integers(1, 6))
    tsb = draw(st.sampled_from([d for d in range(1, sp * b + 1) if (sp * b) % d == 0]))
    return dict(world_size=sp * dp, sp=sp, train_sp_batch_size=tsb,
                gradient_accumulation_steps=draw(st.integers(1, 8)), loader_batch_size=b)


@given(layout=open_sora_layout())
def test_open_sora_log_matches_design_formulas(layout):
    w, sp, tsb = layout["world_size"], layout["sp"], layout["train_sp_batch_size"]
    ga, b = layout["gradient_accumulation_steps"], layout["loader_batch_size"]
    log = open_sora_log(**layout)
    assert log.real_global_batch_size == (w // sp) * tsb * ga  # the sp_size seed's formula
    assert log.logged_global_batch_size * sp == b * w * ga * tsb  # logged = b * world * GA / sp * tsb
    assert log.inner_micro_steps * tsb == sp * b  # micro-steps per loader step
    # Derived: logged / real = (b*w*GA*tsb/sp) / (w*tsb*GA/sp) = b, so the log is right iff b == 1.
    assert log.logged_global_batch_size == b * log.real_global_batch_size
    assert (log.logged_global_batch_size == log.real_global_batch_size) == (b == 1)
    assert log.real_steps_per_epoch is None and log.logged_steps_per_epoch is None


@given(layout=open_sora_layout(), loader_steps=st.integers(1, 50))
def test_open_sora_log_undercounts_updates_by_the_inner_loop(layout, loader_steps):
    # With num_samples a multiple of world*b*GA no ceil rounds: len(dataloader)/GA = loader_steps,
    # while the real count is num_samples / real_global_batch = loader_steps * sp*b/tsb.
    w, b, ga = layout["world_size"], layout["loader_batch_size"], layout["gradient_accumulation_steps"]
    log = open_sora_log(**layout, num_samples=loader_steps * w * b * ga)
    assert log.logged_steps_per_epoch == loader_steps
    assert log.real_steps_per_epoch == loader_steps * log.inner_micro_steps


@pytest.mark.parametrize("kwargs, key", [
    (dict(world_size=8, sp=4, train_sp_batch_size=3, gradient_accumulation_steps=1, loader_batch_size=1),
     "sp*loader_batch_size = 4 is not divisible by train_sp_batch_size = 3"),
    (dict(world_size=8, sp=4, train_sp_batch_size=1, gradient_accumulation_steps=1, loader_batch_size=0),
     "loader_batch_size = 0"),
    (dict(world_size=8, sp=4, train_sp_batch_size=0, gradient_accumulation_steps=1, loader_batch_size=1),
     "micro_batch_size = 0"),
    (dict(world_size=6, sp=4, train_sp_batch_size=1, gradient_accumulation_steps=1, loader_batch_size=1),
     "world_size = 6 is not divisible"),
])
def test_open_sora_log_bad_sizes_raise(kwargs, key):
    with pytest.raises(ConfigError) as err:
        open_sora_log(**kwargs)
    assert key in str(err.value)


def test_open_sora_log_worked_example():
    # 8 ranks, sp 4, b 2, train_sp_batch_size 1, GA 1, 1000 samples: 2 groups of 1 sample per micro-step.
    log = open_sora_log(8, 4, 1, 1, 2, num_samples=1000)
    assert log.real_global_batch_size == 2 and log.logged_global_batch_size == 4
    assert log.inner_micro_steps == 8
    assert log.real_steps_per_epoch == 500
    assert log.logged_steps_per_epoch == math.ceil(1000 / (8 * 2))


# --- learning-rate scaling (Goyal et al. 2017; Krizhevsky 2014 / Malladi et al. 2022) ---------------

@given(lr=st.floats(1e-6, 1.0), batch=size, reference=size)
def test_linear_scaling_is_proportional_and_sqrt_its_square_root(lr, batch, reference):
    linear = scaled_lr(lr, batch, reference, "linear")
    sqrt = scaled_lr(lr, batch, reference, "sqrt")
    assert linear == pytest.approx(lr * batch / reference, rel=1e-12)
    assert sqrt * sqrt == pytest.approx(lr * linear, rel=1e-12)  # sqrt(r)^2 = r
    assert scaled_lr(lr, batch, reference, "none") == lr
    assert scaled_lr(lr, reference, reference, "sqrt") == pytest.approx(lr, rel=1e-15)


def test_trainer_runs_the_scaled_schedule(tmp_path):
    """Global batch 8 against a reference of 2 with linear scaling: every logged lr is 4x the unscaled
    schedule's (warmup and cosine shape unchanged; both are computed by the same lr_at)."""
    from conftest import CONFIG, TINY, train_here
    from meshtrain.config.load import load_config
    from meshtrain.optim.schedule import lr_at

    overrides = {"batch.micro_batch_size": "8", "optim.lr_scaling": "linear", "optim.reference_batch_size": "2"}
    records = train_here(tmp_path / "run", **overrides)
    plain = load_config(CONFIG, {**TINY, "batch.micro_batch_size": "8"}).optim
    logged = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert len(logged) == int(TINY["train.steps"])
    for step, lr in logged.items():
        assert lr == pytest.approx(4 * lr_at(step - 1, plain, int(TINY["train.steps"])), rel=1e-12)
