"""The planner's pipeline stages are the ones the trainer cuts (and Megatron's and DeepSpeed's where those run).

No processes: the trainer's split is :mod:`meshtrain.parallel.pipeline.balance`, torch-free; the planner must charge
its busiest stage (``planner.memory.stage_loads``), not ``ceil(L / pp)`` blocks and the head."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from meshtrain.config.load import load_config
from meshtrain.parallel.pipeline.balance import chunk_ranks, model_item_costs, split_layers
from meshtrain.rules.pipeline import RULES
from meshtrain.planner.cost import step_time
from meshtrain.planner.hardware import get_hardware
from meshtrain.planner.layout import FRAMEWORKS, Layout
from meshtrain.planner.memory import PRECISIONS, pipeline_item_costs, rank_loads, stage_loads
from meshtrain.planner.model_specs import ModelSpec, from_config

MESHTRAIN = FRAMEWORKS["meshtrain"]
MODELS = {  # the trainer's families at 8 blocks, vocabulary 65 (the main job's characters)
    "gpt": {"model.type": "gpt"},
    "gpt with biases": {"model.type": "gpt", "model.bias": "true"},
    "llama": {"model.type": "llama", "model.n_head": "4", "model.n_embd": "64"},
    "llama, tied head": {"model.type": "llama", "model.n_head": "4", "model.n_embd": "64",
                         "model.tie_embeddings": "true"},
    "mixtral": {"model.type": "mixtral", "model.n_head": "4", "model.n_embd": "64", "model.num_experts": "4"},
}
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zbv", 2)]


def _config(name: str):
    return load_config("configs/shakespeare_char.toml", {**MODELS[name], "model.n_layer": "8"})


@pytest.mark.parametrize("name", MODELS)
def test_the_planners_item_costs_are_the_trainers(name):
    """Embedding, block and head cost the same FLOPs per step in the planner's count as in the family's own."""
    cfg = _config(name)
    spec = from_config(cfg, 65)
    for tokens in (0, 1, 4096):
        assert pipeline_item_costs(spec, tokens) == model_item_costs(cfg.model, 65, tokens)


@pytest.mark.parametrize("name, schedule_v, pp, ga", [
    (n, s, pp, ga) for n, s, pp, ga in itertools.product(MODELS, SCHEDULES, (2, 4), (4, 8))])
def test_the_planners_stages_are_the_trainers(name, schedule_v, pp, ga):
    """Every pipeline rank holds, in the planner, the blocks and the head the trainer's split gives it (the chunks of
    ``split_layers`` at the trainer's tokens per step, placed by the schedule)."""
    schedule, v = schedule_v
    cfg = _config(name)
    spec = from_config(cfg, 65)
    layout = Layout(pp=pp, virtual_stages=v, pp_schedule=schedule, gradient_accumulation_steps=ga, micro_batch_size=2)
    chunks = split_layers(8, pp * v, model_item_costs(cfg.model, 65, ga * 2 * cfg.model.block_size))
    ranks = chunk_ranks(pp, pp * v, RULES[schedule].placement)
    trainer = [(sum(len(c.layers) for c in chunks if ranks[c.index] == r),
                any(c.has_head for c in chunks if ranks[c.index] == r)) for r in range(pp)]
    assert list(rank_loads(spec, layout, MESHTRAIN)) == trainer
    assert set(stage_loads(spec, layout, MESHTRAIN)) == set(trainer)


def test_the_busiest_rank_sets_the_step():
    """GPT-2 small on 2 stages: its 50k-word head costs ~5 blocks, so the trainer puts 8 blocks on rank 0 and 4 with
    the head on rank 1. The planner's micro-batch is the busier of the two, and no longer 6 blocks and the head (the
    uniform split's), which is longer than either."""
    model, hw, prec = ModelSpec("gpt2", 12, 768, 12, vocab=50257, seq_len=1024), get_hardware("H100"), PRECISIONS["bf16"]
    layout = Layout(pp=2, gradient_accumulation_steps=8)
    assert rank_loads(model, layout, MESHTRAIN) == ((8, False), (4, True))
    times = {}
    for blocks in range(1, 13):  # a one-stage model of n blocks, with and without its head, as a ruler
        for head in (False, True):
            one = replace(model, layers=blocks, vocab=model.vocab if head else 1)
            times[blocks, head] = step_time(one, Layout(gradient_accumulation_steps=8), hw, prec, MESHTRAIN).compute
    balanced = step_time(model, layout, hw, prec, MESHTRAIN).compute
    uniform = step_time(model, layout, hw, prec, replace(MESHTRAIN, pp_split="uniform")).compute
    assert balanced < uniform
    # the busier rank: 8 blocks (its own time) against 4 blocks and the head; a 1-word "head" costs ~nothing, so the
    # rulers bound it to within that word's share
    assert balanced == pytest.approx(max(times[8, False], times[4, True]), rel=1e-3)


@pytest.mark.parametrize("layers, pp, expected", [
    (70, 12, [(5, False)] + [(6, False)] * 10 + [(5, True)]),  # BLOOM: 72 items, 6 a stage
    (8, 3, [(3, False), (3, False), (2, True)]),  # 10 items: 4, 3, 3; the embedding and head take one each
    (105, 35, [(3, False), (4, False)] + [(3, False)] * 32 + [(2, True)]),  # MT-NLG's shape: 107 items, 2 stages of 4
])
def test_deepspeeds_ends_as_blocks_split(layers, pp, expected):
    """``partition_method = "type:transformer|embedding"``: ``L + 2`` items spread as ``partition_uniform`` spreads
    them (the first ``(L + 2) % pp`` stages one more), the embedding first, the head last."""
    fw = replace(FRAMEWORKS["megatron-deepspeed"], pp_split="ends-as-blocks")
    model = ModelSpec("m", layers, 256, 4, vocab=1000, seq_len=128)
    loads = list(rank_loads(model, Layout(pp=pp, gradient_accumulation_steps=pp), fw))
    assert sum(b for b, _ in loads) == layers and loads[-1][1] and not any(h for _, h in loads[:-1])
    size, extra = divmod(layers + 2, pp)
    sizes = [size + (r < extra) for r in range(pp)]
    assert [b for b, _ in loads] == [s - (r == 0) - (r == pp - 1) for r, s in enumerate(sizes)]
    assert loads == expected


@pytest.mark.parametrize("framework", ["megatron-core", "megatron-2021", "fsdp", "torchtitan"])
def test_megatrons_uniform_split_charges_the_head_beside_the_busiest_stages_blocks(framework):
    model = ModelSpec("m", 10, 256, 4, vocab=1000, seq_len=128)
    assert stage_loads(model, Layout(pp=4, gradient_accumulation_steps=4), FRAMEWORKS[framework]) == ((3, True),)


def test_the_fullest_rank_sets_the_activation_peak():
    """Llama 3 405B on pp 32 under ZB-V: the balanced split leaves the loss's rank 0 (the embedding's and the head's
    chunks) 2 blocks and every other rank 4; each rank holds the same micro-batches in flight, so the peak is a
    4-block rank's: as many activations as the uniform split's 4 blocks a rank, not the loss rank's half of it."""
    from meshtrain.planner.memory import memory_breakdown
    model = ModelSpec("llama3-405b", 126, 16384, 128, kv_heads=8, ffn_hidden=53248, vocab=128256, seq_len=8192,
                      activation="swiglu", tied_embeddings=False)
    hw, prec = get_hardware("H100"), PRECISIONS["bf16"]
    layout = Layout(dp=64, tp=8, pp=32, zero_stage=2, gradient_accumulation_steps=32, pp_schedule="zbv",
                    virtual_stages=2, tp_sequence_parallel=True)
    loads = rank_loads(model, layout, MESHTRAIN)
    assert loads[0] == (2, True) and {b for b, _ in loads[1:]} == {4}
    balanced = memory_breakdown(model, layout, hw, prec, MESHTRAIN).activations
    uniform = memory_breakdown(model, layout, hw, prec, replace(MESHTRAIN, pp_split="uniform")).activations
    assert balanced == pytest.approx(uniform, rel=1e-12)


def test_a_ranks_parameters_follow_its_split():
    """GPT-2 small on 2 stages: the trainer's rank 0 holds 8 blocks and the embedding (the most), rank 1 4 blocks
    and the untied head. Under ZB-V rank 0 holds the first and the last chunk, so the embedding and the head both,
    in any split (the uniform one before put only the larger of the two there)."""
    from meshtrain.planner.memory import stage_params
    model = ModelSpec("gpt2", 12, 768, 12, vocab=50257, seq_len=1024, biases=True, dropout=True)
    layer, emb, head = model.layer_params(), model.embedding_params(), model.head_params() + model.vocab * model.hidden
    one_f_one_b = Layout(pp=2, gradient_accumulation_steps=8)
    assert stage_params(model, one_f_one_b, MESHTRAIN) == 8 * layer + emb
    assert stage_params(model, one_f_one_b, FRAMEWORKS["megatron-core"]) == 6 * layer + max(emb, head)
    zbv = Layout(pp=2, virtual_stages=2, pp_schedule="zbv", gradient_accumulation_steps=8)
    for fw in (MESHTRAIN, replace(MESHTRAIN, pp_split="uniform")):
        blocks0 = rank_loads(model, zbv, fw)[0][0]
        assert rank_loads(model, zbv, fw)[0][1] and stage_params(model, zbv, fw) >= blocks0 * layer + emb + head


@pytest.mark.parametrize("name", ["gpt2", "llama3-405b", "mixtral"])
def test_the_search_floor_of_a_ranks_parameters_holds_for_every_split(name):
    """``search.states_lower_bound`` prunes degrees by :func:`stage_params_floor`: it must not exceed the parameters of
    the fullest rank of any split or schedule, or a layout that fits would never be ranked."""
    from meshtrain.planner.memory import stage_params, stage_params_floor
    from meshtrain.planner.model_specs import preset
    model = {"gpt2": ModelSpec("gpt2", 12, 768, 12, vocab=50257, seq_len=1024),
             "llama3-405b": preset("llama3-405b"), "mixtral": preset("mixtral-8x7b")}[name]
    for fw, (schedule, v), pp, tp, ga in itertools.product(
            (MESHTRAIN, FRAMEWORKS["megatron-core"], replace(FRAMEWORKS["megatron-deepspeed"], pp_split="ends-as-blocks")),
            SCHEDULES, (1, 2, 3, 4, 6), (1, 2, 8), (4, 12, 64)):
        if pp * v > model.layers or (pp == 1 and v > 1):
            continue
        layout = Layout(pp=pp, tp=tp, virtual_stages=v, pp_schedule=schedule, gradient_accumulation_steps=ga)
        assert stage_params_floor(model, tp, pp) <= stage_params(model, layout, fw) * (1 + 1e-12), (fw.name, layout)
