"""DeepSeek-V3's complementary sequence-wise balance loss (``model.seq_aux_loss_alpha``; V3 report arXiv:2412.19437,
Sec. 2.1.2, Eq. 17-20), checked against the equations computed here token by token in fp64:

- one MoE layer's loss and its gradient on the router equal Eq. 17-20 per sequence, averaged over the sequences, with
  the indicator of Eq. 18 over the plain affinities' top-k while the routing itself is group-limited and biased (so
  a loss counted over the routed experts would differ);
- the model's auxiliary loss is alpha x the sum of its MoE layers' losses (the dense first layer has none); off, none;
- DDP dp2 and ep2 x dp2 equal one process (the contract of ``conftest.check_layout``) with alpha = 1, so a loss
  averaged over the wrong sequences or counted over the wrong ranks would show (one 2-rank launch, make test-slow);
- sequence parallelism is refused before launch in one line, and so is a folder whose architecture meshtrain does not
  build (a DeepSeek-V3.2 folder).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshtrain.errors import ConfigError
from meshtrain.models.deepseek_v3.model import DeepseekMoE, sequence_balance_loss
from meshtrain.models.registry import ModelConfig

EPS32 = torch.finfo(torch.float32).eps
LAYER = dict(type="deepseek_v3", n_embd=16, ffn_hidden=8, num_experts=8, num_experts_per_tok=2, n_group=4,
             topk_group=2, n_shared_experts=1, seq_aux_loss_alpha=0.01, router_aux_loss_coef=0.0)
"""8 experts in 4 groups of which 2 may be used, top-2."""


def reference_loss(x: torch.Tensor, router: torch.Tensor, k: int) -> torch.Tensor:
    """Eq. 17-20 in fp64, sequence by sequence and token by token: ``x`` (B, T, C), ``router`` (E, C)."""
    B, T, _ = x.shape
    E = router.shape[0]
    losses = []
    for b in range(B):
        f, P = torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64)
        for t in range(T):
            s = torch.sigmoid(router @ x[b, t])  # (E,) affinities, Eq. 15
            top = set(s.detach().topk(k).indices.tolist())  # TopK({s_j,t}, K_r) of Eq. 18
            f = f + torch.tensor([float(i in top) for i in range(E)], dtype=torch.float64) * E / (k * T)  # Eq. 18
            P = P + s / s.sum() / T  # Eq. 19-20
        losses.append((f * P).sum())  # Eq. 17 without alpha
    return torch.stack(losses).mean()


def layer_and_input(seed: int = 0) -> tuple[DeepseekMoE, torch.Tensor]:
    """A DeepSeekMoE layer with a decisive router and large random selection biases, and x (3, 10, C)."""
    torch.manual_seed(seed)
    layer = DeepseekMoE(ModelConfig(**LAYER))
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        layer.expert_bias.copy_(torch.randn(8))
        for w, _ in layer.experts.expert_weights():
            w.normal_(0.0, 0.1)
    return layer, torch.randn(3, 10, 16)


def test_layer_loss_and_gradient_equal_eq_17_to_20():
    """The value within ``4 (T + E) eps32`` relative and the router's gradient within ``4 (T + E) eps32`` of its largest
    entry: each term is a sum over the T tokens of products of fp32 ratios over the E experts, so fp32 rounding moves
    it by at most about ``(T + E) eps32`` relative (a factor 4 for the mean and the sigmoids)."""
    layer, x = layer_and_input()
    layer(x)
    got = layer.seq_aux_loss
    plain = (x.reshape(-1, 16) @ layer.router.weight.T).topk(2, dim=-1).indices.sort(dim=-1).values
    routed = layer.last_experts.sort(dim=-1).values
    assert not torch.equal(plain, routed), "the biases and the group limit should move some token's experts"
    router = layer.router.weight.detach().double().requires_grad_()
    want = reference_loss(x.double(), router, 2)
    want.backward()
    got.backward()
    tol = 4 * (10 + 8) * EPS32
    torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=0)
    grad = router.grad
    torch.testing.assert_close(layer.router.weight.grad.double(), grad, rtol=0, atol=tol * float(grad.abs().max()))


def test_balanced_sequence_gives_one_and_the_worst_gives_e_over_k():
    """The loss's two ends (Eq. 17-20): every expert with ``f_i = 1`` and ``P_i = 1/E`` gives 1; every token putting all
    its affinity on the same k experts gives ``E/k``."""
    E, k, T = 8, 2, 16
    balanced = torch.full((1, T, E), 1.0 / E)
    balanced[0, torch.arange(T), (2 * torch.arange(T)) % E] += 1e-3  # ties broken so each expert is picked T*k/E times
    balanced[0, torch.arange(T), (2 * torch.arange(T) + 1) % E] += 1e-3
    balanced = balanced / balanced.sum(-1, keepdim=True)
    torch.testing.assert_close(sequence_balance_loss(balanced, k), torch.tensor(1.0), rtol=1e-2, atol=0)  # the 1e-3s
    worst = torch.zeros(1, T, E)
    worst[..., :k] = 1.0 / k
    torch.testing.assert_close(sequence_balance_loss(worst, k), torch.tensor(E / k))


def test_model_aux_loss_is_alpha_times_the_layers_sum():
    """``aux_loss()`` = alpha x the sum over the MoE layers of Eq. 17-20 of each layer's input (captured by hooks), the
    dense first layer's none; with alpha 0, no layer computes one (``router_aux_loss_coef`` 0: the loss is 0). Tolerance as above, summed
    over 2 layers."""
    from meshtrain.models.build import build_model

    cfg = ModelConfig(**{**LAYER, "n_layer": 3, "n_head": 2, "block_size": 12, "kv_lora_rank": 8,
                         "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "first_k_dense_replace": 1,
                         "seq_aux_loss_alpha": 0.5})
    torch.manual_seed(0)
    model = build_model(cfg, 11)
    inputs = {}
    for i, block in model.blocks.items():
        if isinstance(block.mlp, DeepseekMoE):
            block.mlp.register_forward_hook(lambda mod, args, out, i=i: inputs.__setitem__(i, args[0].detach()))
    model(torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(1)))
    assert sorted(inputs) == ["1", "2"]
    want = sum(reference_loss(inputs[i].double(), model.blocks[i].mlp.router.weight.detach().double(), 2)
               for i in inputs)
    torch.testing.assert_close(model.aux_loss().double(), 0.5 * want, rtol=2 * 4 * (12 + 8) * EPS32, atol=0)
    torch.manual_seed(0)
    off = build_model(ModelConfig(**{**cfg.__dict__, "seq_aux_loss_alpha": 0.0}), 11)
    off(torch.zeros(2, 12, dtype=torch.long))
    assert all(getattr(b.mlp, "seq_aux_loss", None) is None for b in off.blocks.values())
    assert float(off.aux_loss().detach()) == 0.0  # router_aux_loss_coef's 0 x the batch-level loss


def test_training_forward_adds_the_loss_to_the_routers_gradients():
    """The loss reaches the routers through the model's forward (``attach_aux_loss``, weight 1 for one micro-batch):
    the routers' gradients of the cross-entropy with alpha = 0.5, minus those with alpha = 0 (the same weights, the
    same forward), equal the gradients of ``aux_loss()``, the value checked against Eq. 17-20 above. The difference of
    two fp32 gradients of one backward each: within ``8 (T + E) eps32`` of the largest gradient entry."""
    import torch.nn.functional as F

    from meshtrain.models.build import build_model

    cfg = ModelConfig(**{**LAYER, "n_layer": 3, "n_head": 2, "block_size": 12, "kv_lora_rank": 8,
                         "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "first_k_dense_replace": 1,
                         "seq_aux_loss_alpha": 0.5})
    idx = torch.randint(0, 11, (2, 13), generator=torch.Generator().manual_seed(1))
    grads = []
    for alpha in (0.5, 0.0):
        torch.manual_seed(0)
        model = build_model(ModelConfig(**{**cfg.__dict__, "seq_aux_loss_alpha": alpha}), 11)
        routers = [b.mlp.router.weight for b in model.blocks.values() if isinstance(b.mlp, DeepseekMoE)]
        F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
        grads.append(torch.cat([w.grad.flatten() for w in routers]))
    torch.manual_seed(0)
    model = build_model(cfg, 11)
    model(idx[:, :-1])
    routers = [b.mlp.router.weight for b in model.blocks.values() if isinstance(b.mlp, DeepseekMoE)]
    want = torch.cat([g.flatten() for g in torch.autograd.grad(model.aux_loss(), routers)])
    assert float(want.abs().max()) > 0
    tol = 8 * (12 + 8) * EPS32 * float(grads[0].abs().max())
    torch.testing.assert_close(grads[0] - grads[1], want, rtol=0, atol=tol)


TINY = {"model.block_size": "32", "optim.warmup_steps": "2", "optim.lr": "3e-3", "train.log_interval": "1",
        "train.eval_interval": "0", "train.eval_steps": "2", "checkpoint.interval": "0", "train.dtype": "float32"}
MODEL = {**TINY, "model.type": "deepseek_v3", "model.n_layer": "2", "model.n_head": "4", "model.n_embd": "32",
         "model.kv_lora_rank": "16", "model.q_lora_rank": "0", "model.qk_nope_head_dim": "8",
         "model.qk_rope_head_dim": "4", "model.v_head_dim": "8", "model.ffn_hidden": "16", "model.num_experts": "8",
         "model.num_experts_per_tok": "2", "model.n_group": "2", "model.topk_group": "1",
         "model.first_k_dense_replace": "1", "model.router_aux_loss_coef": "0", "model.seq_aux_loss_alpha": "1.0",
         "train.steps": "3"}
"""3 steps, the sequence-wise loss at weight 1 (the only auxiliary loss), so that one averaged over the wrong
sequences moves the loss and the router's gradient."""
LAYOUTS = {"dp2": {"batch.micro_batch_size": "2"},
           "ep2-dp2": {"parallel.ep": "2", "batch.micro_batch_size": "2"}}
"""Each rank 2 sequences a micro-batch, one process 4 (:func:`test_layout_equals_one_process`)."""


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from layout_worker import launch_layouts, reference_run

    root = tmp_path_factory.mktemp("seq_balance")
    (root / "w2").mkdir()
    results = launch_layouts(2, root / "w2", {n: {**MODEL, **o} for n, o in LAYOUTS.items()})
    reference = reference_run(root / "one", {**MODEL, "batch.micro_batch_size": "4"})
    return results, reference


@pytest.mark.slow  # one 2-rank launch, ~18 s: make test stays under 15 minutes (the loss is per sequence, local to a
# rank; the equations, the model's sum and the gradient path run in make test above)
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_equals_one_process(launched, name):
    """DDP dp2 (and ep2 over it) with 2 sequences per rank vs one process with all 4: each rank's mean over its
    sequences, averaged over the ranks with the gradients, is the mean over the 4; the contract's tolerances."""
    from conftest import check_layout

    results, reference = launched
    check_layout(results[name], reference, {**MODEL, **LAYOUTS[name]})


def test_sequence_parallelism_is_refused_in_one_line():
    from meshtrain.config.load import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, {**MODEL, "parallel.sp": "2", "parallel.dp": "1"})
    text = str(e.value)
    assert "\n" not in text and "model.seq_aux_loss_alpha = 1.0 (the sequence-wise balance loss) is not supported " \
                                "with parallel.sp = 2" in text, text


def test_a_folder_of_an_architecture_meshtrain_does_not_build_is_one_line(tmp_path):
    """A DeepSeek folder whose ``architectures`` names DeepSeek-V3.2 (sparse attention, which meshtrain does not build)
    is refused in one line naming it and the supported ones, not read as a V3."""
    from meshtrain.models import hf_io as hf
    from meshtrain.models.registry import hf_model_keys

    folder = tmp_path / "hf"
    folder.mkdir()
    data = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 32}
    (folder / hf.CONFIG_FILE).write_text(json.dumps(data))
    with pytest.raises(hf.HFFormatError) as e:
        hf_model_keys(data, Path(folder / hf.CONFIG_FILE))
    text = str(e.value)
    assert "\n" not in text and "describes DeepseekV32ForCausalLM, which meshtrain does not build" in text
    assert "DeepseekV3ForCausalLM" in text, text
