"""MoE routing, balancing losses, capacity and permutation (megalite/moe/router.py,
megalite/moe/dispatch.py; docs/moe.md) against the references they follow: megatron-core's
moe_utils and TopKRouter on the same random logits (values and gradients, fp32, 1e-6), and
Hugging Face's DeepSeek-V3 / GLM-4-MoE routers for their group-score rule.

The megatron functions that reach torch.distributed or its parallel_state need a process group:
``mpu`` makes a gloo world of one in this process for this module only and takes it down after,
tracker included (the rest of the suite starts its process groups in worker processes).
"""

import importlib.util
import warnings

import pytest
import torch
import transformers

from dist_utils import free_port
from megalite.config import ConfigError, ModelConfig
from megalite.moe.dispatch import permute, unpermute
from megalite.moe.router import (drop_over_capacity, expert_bias_update, expert_capacity, route,
                                 scores_for_aux_loss, seq_load_balancing_loss,
                                 switch_load_balancing_loss, z_loss)

TOL = dict(rtol=1e-6, atol=1e-6)
T, E = 48, 16


@pytest.fixture(scope="module")
def mu():
    """megatron.core.transformer.moe.moe_utils (the test extra: missing, the tests fail)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no apex / Transformer Engine: megatron says so, loudly
        from megatron.core.transformer.moe import moe_utils
    return moe_utils


@pytest.fixture(scope="module")
def mpu(mu):
    """A gloo world of one plus megatron's parallel_state, for this module only."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    assert not dist.is_initialized(), "a process group already exists in this process"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        yield parallel_state
    finally:
        mu.clear_aux_losses_tracker()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _logits(seed=0, tokens=T, experts=E):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def _grad(fn, logits, seed=1):
    """d(Σ w·fn(x)) / dx for a fixed random w: compares a whole Jacobian in one backward pass."""
    x = logits.clone().requires_grad_(True)
    out = fn(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * w).sum().backward()
    return out.detach(), x.grad


ROUTE_CASES = {  # name: (topk, our kwargs); megatron takes the same ones under its own names
    "softmax": (2, {}),
    "softmax-pre": (2, dict(pre_softmax=True)),
    "softmax-pre-k1": (1, dict(pre_softmax=True)),
    "softmax-pre-scaled": (3, dict(pre_softmax=True, scaling_factor=2.5)),
    "softmax-groups": (4, dict(num_groups=4, group_topk=2)),
    "softmax-pre-groups": (6, dict(pre_softmax=True, num_groups=4, group_topk=2)),  # top-3 sums
    "sigmoid": (4, dict(score_function="sigmoid")),
    "sigmoid-k1": (1, dict(score_function="sigmoid")),
    "sigmoid-bias": (4, dict(score_function="sigmoid", expert_bias="rand")),
    "deepseek-v3-like": (4, dict(score_function="sigmoid", num_groups=4, group_topk=2,
                                 scaling_factor=2.5, expert_bias="rand")),
}


@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_route_matches_megatron(mu, case):
    topk, kw = ROUTE_CASES[case]
    kw = dict(kw)
    if kw.get("expert_bias") == "rand":
        kw["expert_bias"] = 0.3 * torch.randn(E, generator=torch.Generator().manual_seed(7))
    theirs_kw = dict(kw)
    theirs_kw["use_pre_softmax"] = theirs_kw.pop("pre_softmax", False)
    logits = _logits()
    ours, g_ours = _grad(lambda x: route(x, topk, **kw)[0], logits)
    theirs, g_theirs = _grad(lambda x: mu.topk_routing_with_score_function(x, topk, **theirs_kw)[0],
                             logits)
    m_ours = route(logits, topk, **kw)[1]
    m_theirs = mu.topk_routing_with_score_function(logits, topk, **theirs_kw)[1]
    assert torch.equal(m_ours, m_theirs)
    assert (m_ours.sum(1) == topk).all()
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(g_ours, g_theirs, **TOL)
    assert g_ours.abs().sum() > 0  # the router learns through the gates


def test_group_limited_topk_matches_megatron_and_limits_groups(mu):
    logits, groups, group_topk, topk = _logits(2), 8, 2, 4
    scores = logits.softmax(-1)
    _, idx = mu.group_limited_topk(scores, topk, T, E, groups, group_topk)
    _, ours = route(logits, topk, pre_softmax=True, num_groups=groups, group_topk=group_topk)
    assert torch.equal(ours, torch.zeros_like(ours).scatter(1, idx, True))
    groups_used = ours.view(T, groups, -1).any(-1).sum(-1)
    assert (groups_used <= group_topk).all()
    # the limit binds: unconstrained top-k would have spread over more groups for some tokens
    _, free = route(logits, topk, pre_softmax=True)
    assert not torch.equal(ours, free)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("normalize", [True, False])
def test_top2_sum_group_score_matches_hugging_face(family, normalize):
    """DeepSeek-V3 and GLM-4-MoE score a group by its best two experts whatever top-k is; with
    E=32, 8 groups, 4 chosen and k=4 Megatron's rule scores by the best one: they differ."""
    # setup.py admits transformers releases older than these families: a family the installed
    # transformers lacks skips; one it has must import
    if importlib.util.find_spec(f"transformers.models.{family}") is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name = {"deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe"}[family]
    experts, topk, groups, group_topk, scale = 32, 4, 8, 4, 2.5
    cfg = getattr(mod, f"{name}Config")(
        hidden_size=experts, n_routed_experts=experts, num_experts_per_tok=topk, n_group=groups,
        topk_group=group_topk, norm_topk_prob=normalize, routed_scaling_factor=scale)
    router = getattr(mod, f"{name}TopkRouter")(cfg)
    bias = 0.05 * torch.randn(experts, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))  # router_logits = the hidden states themselves
        router.e_score_correction_bias.copy_(bias)
    logits = _logits(4, experts=experts)
    _, weights, idx = router(logits)
    hf = torch.zeros_like(logits).scatter(1, idx, weights)
    kw = dict(score_function="sigmoid", num_groups=groups, group_topk=group_topk,
              scaling_factor=scale, expert_bias=bias, normalize=normalize)
    probs, routing_map = route(logits, topk, group_score="top2_sum", **kw)
    torch.testing.assert_close(probs, hf, **TOL)
    assert torch.equal(routing_map, hf != 0)
    assert not torch.equal(route(logits, topk, group_score="topk_sum", **kw)[1], routing_map)


def test_expert_bias_steers_the_choice_not_the_gates():
    logits = _logits(5)
    bias = torch.zeros(E)
    bias[3] = 10.0  # every token now picks expert 3
    probs, routing_map = route(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert routing_map[:, 3].all()
    s = logits.sigmoid()
    chosen = torch.where(routing_map, s, torch.zeros_like(s))
    torch.testing.assert_close(probs, chosen / chosen.sum(-1, keepdim=True), **TOL)


def test_sigmoid_without_renormalisation_keeps_raw_scores():
    logits = _logits(6)
    probs, routing_map = route(logits, 3, score_function="sigmoid", normalize=False)
    torch.testing.assert_close(probs, torch.where(routing_map, logits.sigmoid(), 0.0), **TOL)
    assert not torch.allclose(probs.sum(-1), torch.ones(T))


@pytest.mark.parametrize("kw, flag", [
    (dict(topk=1), "--moe-router-pre-softmax"),
    (dict(topk=17), "--moe-router-topk"),
    (dict(topk=2, score_function="tanh"), "--moe-router-score-function"),
    (dict(topk=2, enable_expert_bias=True), "--moe-router-enable-expert-bias"),
    (dict(topk=2, num_groups=3, group_topk=1), "--moe-router-num-groups"),
    (dict(topk=2, num_groups=4, group_topk=5), "--moe-router-group-topk"),
    (dict(topk=1, pre_softmax=True, num_groups=4, group_topk=2), "--moe-router-group-topk"),
])
def test_inconsistent_router_options_are_config_errors(kw, flag):
    """The router's rules are checked once, by the configuration, never per forward."""
    with pytest.raises(ConfigError, match=flag):
        ModelConfig(num_experts=E, **{f"moe_router_{k}": v for k, v in kw.items()}).validate()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_value_and_gradient_match_megatron(mu, score_function):
    topk, coeff, logits = 2, 1e-2, _logits(8)

    def ours(x):
        scores, routing_map = scores_for_aux_loss(x, topk, score_function)
        return switch_load_balancing_loss(scores, routing_map.sum(0), T, topk, E, coeff)

    def theirs(x):
        routing_map, scores = mu.compute_routing_scores_for_aux_loss(x, topk, score_function)
        return mu.switch_load_balancing_loss_func(scores, routing_map.sum(0), T, topk, E, coeff)

    v_ours, g_ours = _grad(ours, logits)
    v_theirs, g_theirs = _grad(theirs, logits)
    torch.testing.assert_close(v_ours, v_theirs, **TOL)
    torch.testing.assert_close(g_ours, g_theirs, **TOL)
    assert v_ours > coeff * 0.9 and g_ours.abs().sum() > 0  # ≈ coeff when balanced, more if not


def test_z_loss_value_and_gradient_match_megatron(mu):
    logits = 3 * _logits(9)
    v_ours, g_ours = _grad(lambda x: z_loss(x, 1e-3), logits)
    v_theirs, g_theirs = _grad(lambda x: mu.z_loss_func(x, 1e-3), logits)
    torch.testing.assert_close(v_ours, v_theirs, **TOL)
    torch.testing.assert_close(g_ours, g_theirs, **TOL)
    assert v_ours > 0


def test_seq_aux_loss_is_the_mean_of_per_sequence_losses():
    s, b, topk, coeff = 12, 4, 2, 1e-2
    scores, routing_map = scores_for_aux_loss(_logits(10, tokens=s * b), topk)
    scores, routing_map = scores.view(s, b, E), routing_map.view(s, b, E)
    per_seq = [switch_load_balancing_loss(scores[:, i], routing_map[:, i].sum(0), s, topk, E, coeff)
               for i in range(b)]
    seq = seq_load_balancing_loss(scores, routing_map.sum(0), s, topk, coeff)
    torch.testing.assert_close(seq, torch.stack(per_seq).mean(), **TOL)
    whole = switch_load_balancing_loss(scores.view(-1, E), routing_map.view(-1, E).sum(0), s * b,
                                       topk, E, coeff)
    assert not torch.isclose(seq, whole)  # a different loss, not a renaming


@pytest.mark.filterwarnings("ignore::UserWarning")  # TransformerConfig's notes on unset fields
@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_router_losses_end_to_end_match_megatron_topk_router(mu, mpu, balancing, score_function):
    """Megatron's TopKRouter.routing on [s, b, E] logits: routing, the balancing loss (read from
    its tracker) and z-loss, and the gradient these losses give the logits (its auto-scaler
    passes a unit gradient to each loss in the backward of the probs)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    s, b, topk, coeff, zc = 12, 3, 2, 1e-2, 1e-3
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=E,
                            moe_router_topk=topk, moe_router_score_function=score_function,
                            moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=coeff,
                            moe_z_loss_coeff=zc, use_cpu_initialization=True)
    router = TopKRouter(cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    router.train()
    mu.clear_aux_losses_tracker()
    logits = _logits(11, tokens=s * b).view(s, b, E).requires_grad_(True)
    probs_theirs, map_theirs = router.routing(logits)
    probs_theirs.backward(torch.zeros_like(probs_theirs))  # only the attached losses' gradients
    tracker = mu.get_moe_layer_wise_logging_tracker()
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}[balancing]
    loss_theirs, z_theirs = tracker[name]["values"][0], tracker["z_loss"]["values"][0]

    x = logits.detach().view(-1, E).requires_grad_(True)
    probs, routing_map = route(x, topk, score_function=score_function)
    scores, aux_map = scores_for_aux_loss(x, topk, score_function)
    if balancing == "aux_loss":
        loss = switch_load_balancing_loss(scores, aux_map.sum(0), s * b, topk, E, coeff)
    else:
        loss = seq_load_balancing_loss(scores.view(s, b, E), aux_map.view(s, b, E).sum(0), s,
                                       topk, coeff)
    z = z_loss(x, zc)
    (loss + z).backward()
    assert torch.equal(routing_map, map_theirs)
    torch.testing.assert_close(probs, probs_theirs.detach(), **TOL)
    torch.testing.assert_close(loss / coeff, loss_theirs, **TOL)
    torch.testing.assert_close(z / zc, z_theirs, **TOL)
    torch.testing.assert_close(x.grad, logits.grad.view(-1, E), **TOL)
    mu.clear_aux_losses_tracker()


def test_expert_bias_update_matches_megatron(mu, mpu):
    counts = torch.tensor([5.0, 0.0, 3.0, 8.0, 4.0, 4.0, 1.0, 7.0])  # mean 4: expert 4, 5 at it
    bias = torch.linspace(-0.1, 0.1, 8)
    ours = expert_bias_update(bias, counts, 1e-3)
    theirs = mu.get_updated_expert_bias(counts.clone(), bias, 1e-3)  # all-reduces in place
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(ours - bias, 1e-3 * torch.tensor([-1.0, 1, 1, -1, 0, 0, 1, -1]),
                               **TOL)


def test_capacity_matches_megatron(mu):
    for tokens, topk, factor in [(48, 2, 1.0), (48, 2, 1.25), (7, 3, 0.5), (1000, 8, 1.1)]:
        assert expert_capacity(tokens, E, topk, factor) == mu.get_capacity(tokens * topk, E, factor)
    assert expert_capacity(48, 16, 2, 1.0) == 6


@pytest.mark.parametrize("pad", [False, True])
def test_drop_by_probs_matches_megatron(mu, pad):
    topk, factor = 2, 1.0
    logits = _logits(12)
    logits[:, 0] += 2.0  # an overloaded expert, so that something is dropped
    probs, routing_map = route(logits, topk)
    capacity = expert_capacity(T, E, topk, factor)
    ours_p, ours_m = drop_over_capacity(probs, routing_map, capacity, "probs", pad)
    theirs_p, theirs_m = mu.apply_router_token_dropping(probs, routing_map, topk, factor, "probs",
                                                        pad)
    torch.testing.assert_close(ours_p, theirs_p, **TOL)
    kept = ours_m & routing_map
    assert kept.sum() < routing_map.sum()  # tokens were dropped
    assert (kept.sum(0) <= capacity).all()
    assert torch.equal(kept, theirs_m & routing_map)
    if pad:  # padding rows: which zero-probability tokens fill them is ours to choose
        assert (ours_m.sum(0) == capacity).all() and (theirs_m.sum(0) == capacity).all()
    else:
        assert torch.equal(ours_m, theirs_m)
    # per overloaded expert, the kept tokens are those of highest probability
    col_kept, col_dropped = probs[kept[:, 0], 0], probs[routing_map[:, 0] & ~kept[:, 0], 0]
    assert col_dropped.numel() > 0 and col_kept.min() > col_dropped.max()


def test_drop_by_position_keeps_the_earliest_tokens():
    routing_map = torch.zeros(10, 3, dtype=torch.bool)
    routing_map[[1, 2, 4, 6, 7, 9], 0] = True  # expert 0: 6 tokens, capacity 3
    routing_map[[0, 5], 1] = True
    probs = torch.rand(10, 3, generator=torch.Generator().manual_seed(0)) * routing_map
    p, m = drop_over_capacity(probs, routing_map, 3, "position")
    assert m[:, 0].nonzero().flatten().tolist() == [1, 2, 4]
    assert torch.equal(m[:, 1:], routing_map[:, 1:])
    torch.testing.assert_close(p, probs * m)
    _, padded = drop_over_capacity(probs, routing_map, 3, "position", pad_to_capacity=True)
    assert padded[:, 1].nonzero().flatten().tolist() == [0, 1, 5]  # routed 0, 5, then token 1
    assert padded[:, 2].nonzero().flatten().tolist() == [0, 1, 2]
    with pytest.raises(ConfigError, match="--moe-token-drop-policy"):  # checked by the config
        ModelConfig(num_experts=E, moe_token_drop_policy="random").validate()


def test_permute_and_unpermute_match_megatron(mu):
    probs, routing_map = route(_logits(13), 3, pre_softmax=True)
    tokens = torch.randn(T, 8, generator=torch.Generator().manual_seed(14))
    permuted, idx, per_expert = permute(tokens, routing_map)
    theirs, _, theirs_idx = mu.permute(tokens, routing_map)
    assert torch.equal(idx, theirs_idx) and torch.equal(permuted, theirs)
    assert per_expert.tolist() == routing_map.sum(0).tolist() and per_expert.sum() == 3 * T
    expert_out = torch.randn(permuted.shape, generator=torch.Generator().manual_seed(15))
    theirs_out = mu.unpermute(expert_out, theirs_idx, tokens.shape, probs, routing_map)
    torch.testing.assert_close(unpermute(expert_out, idx, probs, routing_map), theirs_out, **TOL)


def test_permute_groups_by_expert_keeping_token_order():
    _, routing_map = route(_logits(16), 2)
    tokens = torch.arange(T, dtype=torch.float32).unsqueeze(1)
    permuted, idx, per_expert = permute(tokens, routing_map)
    start = 0
    for e, n in enumerate(per_expert.tolist()):
        block = idx[start:start + n]
        assert block.tolist() == routing_map[:, e].nonzero().flatten().tolist()  # ascending
        start += n
    assert torch.equal(permuted.flatten().long(), idx)


def test_dispatch_then_combine_is_the_identity():
    """Identity experts and gates that sum to 1 per token: combine(dispatch(x)) = x, and the
    gradient reaches both the tokens and the gates."""
    probs, routing_map = route(_logits(17), 4, score_function="sigmoid")
    probs.requires_grad_(True)
    tokens = torch.randn(T, 8, generator=torch.Generator().manual_seed(18), requires_grad=True)
    permuted, idx, _ = permute(tokens, routing_map)
    out = unpermute(permuted, idx, probs, routing_map)
    torch.testing.assert_close(out, tokens, **TOL)
    out.square().sum().backward()
    assert tokens.grad.abs().sum() > 0 and probs.grad[routing_map].abs().sum() > 0
    assert (probs.grad[~routing_map] == 0).all()  # no gradient to experts a token never met


def test_permute_with_a_known_row_count_is_the_same_without_a_host_read():
    """Dropless (k per token) and capacity padding (C per expert) fix the row count: the
    argsort path gives the masked_select path's rows, order and combine, with no read."""
    from host_reads import HostReads

    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(10, 6, generator=g)
    probs, routing_map = route(torch.randn(10, 5, generator=g), 2)
    want = permute(tokens, routing_map)
    with HostReads() as reads:
        got = permute(tokens, routing_map, 20)
        out = unpermute(got[0], got[1], probs, routing_map, 20)
    assert sum(reads.per_iteration[-1].values()) == 0, reads.per_iteration
    with HostReads() as reads:  # the control: the masked_select path is seen reading
        permute(tokens, routing_map)
    assert sum(reads.per_iteration[-1].values()) == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    torch.testing.assert_close(out, unpermute(want[0], want[1], probs, routing_map))
