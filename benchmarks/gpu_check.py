"""Helpers for benchmarks/gpu_check.sh (run that, not this): env report, CUDA-vs-CPU correctness,
the context-parallel block kernels, and the summary. Each subcommand writes one JSON result to
--result; exit code 0 = pass, NOT_RUN (77) = the check did not run (no CUDA device).

    python benchmarks/gpu_check.py env --result env.json
    python benchmarks/gpu_check.py correctness --device cuda --result corr.json
    python benchmarks/gpu_check.py cp_blocks --device cuda --result cp_blocks.json
    python benchmarks/gpu_check.py doc_attention --device cuda --result doc_attention.json
    python benchmarks/gpu_check.py attention_sinks --device cuda --result attention_sinks.json
    python benchmarks/gpu_check.py linear_attention --device cuda --result linear_attention.json
    python benchmarks/gpu_check.py syncs --device cuda --result syncs.json
    python benchmarks/gpu_check.py offload --device cuda --result offload.json
    python benchmarks/gpu_check.py summarize --work DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NOT_RUN = 77  # the exit status of a check that could not run here; gpu_check.sh reports "skip"


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    print(json.dumps(obj, indent=1, default=str))


# ------------------------------------------------------------------------------------------- env
def cmd_env(args):
    import torch.distributed as dist

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "cpu_count": os.cpu_count(), "gloo_available": dist.is_gloo_available(),
            "nccl_available": dist.is_nccl_available()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001 - report, don't fail
        info["transformers"] = f"missing ({e})"
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device_name=p.name, capability=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2 ** 30, 1))
        try:
            info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001
            info["nccl_version"] = f"unavailable ({e})"
        # The measured bf16 matmul ceiling (random data), to set MFU beside.
        n = 8192
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for _ in range(3):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        torch.cuda.synchronize()
        info["bf16_matmul_tflops_measured"] = round(2 * n ** 3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12, 1)
        # NCCL across ranks needs 2+ GPUs; a 1-rank group at least shows the library loads and runs.
        try:
            dist.init_process_group("nccl", init_method=f"file://{args.result}.store", rank=0,
                                    world_size=1, device_id=torch.device("cuda", 0))
            t = torch.ones(4, device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            info["nccl_1rank_all_reduce"] = "ok" if t.sum().item() == 4 else f"wrong result {t.tolist()}"
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            info["nccl_1rank_all_reduce"] = f"error: {type(e).__name__}: {e}"[:300]
    from megalite.logging import peak_flops_per_device
    if torch.cuda.is_available():
        info["megalite_peak_bf16_tflops"] = peak_flops_per_device(torch.device("cuda", 0)) / 1e12
    _write(args.result, info)
    return 0


# ----------------------------------------------------------------------------------- correctness
def _model_config(family, dtype):
    from megalite.config import ModelConfig

    base = dict(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128,
                vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype)
    if family == "llama":
        base.update(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                    add_bias_linear=False, untie_embeddings_and_output_weights=True,
                    num_query_groups=2, ffn_hidden_size=512)
    return ModelConfig(**base)


def _run(family, dtype, device, tokens, labels, seed=1234, weights=None):
    from megalite.models import GPTModel
    from megalite.parallel_state import ParallelState

    model = GPTModel(_model_config(family, dtype), ParallelState(device=torch.device(device)),
                     seed=seed, device=torch.device(device))
    init = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    if weights is not None:  # compare kernels on identical weights
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])
    tokens, labels = tokens.to(device), labels.to(device)
    logits = model(tokens).float()
    loss = model(tokens, labels=labels).float().mean()
    loss.backward()
    params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().cpu(), loss.item(), params, grads, init


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cmd_correctness(args):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (TF32 would be ~1e-3 off)
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (4, 129), generator=g)
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    res, ok = {"device": args.device}, True
    for family in ("gpt2", "llama"):
        ref_logits, ref_loss, _, ref_grads, ref_init = _run(family, "float32", "cpu", tokens, labels)
        # fp32 on the device under test against fp32 on the CPU, on the CPU's weights. The
        # device's own init is a different draw (generated on the device, megalite/models/init.py):
        # check that each large tensor has the CPU draw's standard deviation.
        logits, loss, _, grads, init = _run(family, "float32", args.device, tokens, labels,
                                            weights=ref_init)
        big = [n for n in ref_init if ref_init[n].numel() >= 10000]
        r = {"init_std_rel": max(abs(init[n].std().item() / ref_init[n].std().item() - 1)
                                 for n in big),
             "logits_max_abs": (logits - ref_logits).abs().max().item(),
             "loss_ref": ref_loss, "loss": loss, "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
             "grad_max_abs": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
             "grad_max_rel": max(_rel(grads[n], ref_grads[n]) for n in ref_grads),
             "num_grads": len(grads)}
        r["pass"] = (r["init_std_rel"] <= 0.05 and r["logits_max_abs"] <= 1e-4 and r["loss_rel"] <= 1e-5
                     and r["grad_max_abs"] <= 1e-5 and r["grad_max_rel"] <= 1e-4
                     and len(grads) == len(ref_grads))
        res[f"{family}_fp32"] = r
        # bf16 sanity: the same model in bf16 on the device, against the fp32 CPU reference.
        logits, loss, _, grads, _ = _run(family, "bfloat16", args.device, tokens, labels,
                                         weights=ref_init)
        finite = bool(torch.isfinite(logits).all()) and all(torch.isfinite(t).all() for t in grads.values())
        b = {"finite": finite, "logits_rel": _rel(logits, ref_logits), "loss": loss,
             "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
             "grad_rel_median": statistics.median(_rel(grads[n], ref_grads[n]) for n in ref_grads)}
        b["pass"] = finite and b["logits_rel"] <= 3e-2 and b["loss_rel"] <= 1e-2 and b["grad_rel_median"] <= 5e-2
        res[f"{family}_bf16"] = b
        ok = ok and r["pass"] and b["pass"]
    res["pass"] = ok
    _write(args.result, res)
    return 0 if ok else 1


# ------------------------------------------------------------------------------------- cp_blocks
# Max |error| over max |reference| against the math path on the same inputs. fp32: the fused
# kernels accumulate in fp32 (TF32 off); bf16: both round out and grads to bf16, the kernels also
# P before P·V.
CP_BLOCK_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def cp_block_cases(kernels, device, dtypes=("bfloat16", "float32"), head_dims=(64, 128),
                   seq=512, heads=8):
    """Each kernel of megalite/context_parallel/blocks.py against its MATH block, forward and
    backward, per dtype, head dim and GQA ratio (heads/K-V groups 1 and 4), on the three block
    shapes the ring and all-gather run (square causal; fewer and more queries than keys, unmasked),
    each a strided view of larger tensors as the ring passes it. One dict per case; a kernel
    that does not fit a dtype/head dim is listed as "n/a"."""
    from megalite.context_parallel import blocks

    cases, gen = [], torch.Generator(device=device).manual_seed(0)
    for kernel in kernels:
        for dtype in dtypes:
            for d in head_dims:
                for rep in (1, 4):
                    def rand(h, s):
                        return torch.randn(2, h, 2 * s, d, device=device, generator=gen).to(
                            getattr(torch, dtype))[:, :, s // 2:s // 2 + s]
                    q, do = rand(heads, seq), rand(heads, seq)
                    k, v = rand(heads // rep, seq), rand(heads // rep, seq)
                    case = {"kernel": kernel.name, "dtype": dtype, "head_dim": d, "rep": rep}
                    if hasattr(kernel, "fits") and not kernel.fits(q, k):
                        cases.append({**case, "status": "n/a"})
                        continue
                    errs = {}
                    try:
                        for shape, rows, keys, causal in (
                                ("square causal", slice(None), slice(None), True),
                                ("fewer queries", slice(seq // 2, None), slice(None), False),
                                ("more queries", slice(None), slice(0, seq // 2), False)):
                            e = blocks.block_errors(kernel, q[:, :, rows], k[:, :, keys],
                                                    v[:, :, keys], do[:, :, rows], causal,
                                                    d ** -0.5)
                            for name, x in zip(("out", "lse", "dq", "dk", "dv"), e):
                                errs[f"{shape} {name}"] = float(x)
                    except Exception as ex:  # noqa: BLE001 - a kernel that fails is a failure
                        cases.append({**case, "status": "fail",
                                      "error": f"{type(ex).__name__}: {ex}"[:300]})
                        continue
                    worst = max(errs.values())
                    ok = worst <= CP_BLOCK_TOLERANCE.get(dtype, 1e-4)  # NaN fails too
                    cases.append({**case, "status": "pass" if ok else "fail", "max_error": worst,
                                  "errors": errs})
    return cases


def cmd_cp_blocks(args):
    """The CUDA kernels of context-parallel attention's p2p/allgather blocks (flash, cuDNN,
    memory-efficient SDPA) against the math path, forward and backward, bf16 and fp32, and which
    kernel --cp-attention-kernel auto picks for each (with any self-check warning). Without
    CUDA nothing here can run: the result says so and the exit status is NOT_RUN."""
    import warnings

    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        _write(args.result, {"ran": False, "pass": False, "device": args.device,
                             "reason": "no CUDA device: the CUDA block kernels were not checked "
                                       "(the CPU kernel is tested by the test suite)"})
        return NOT_RUN
    from megalite.context_parallel import blocks

    torch.backends.cuda.matmul.allow_tf32 = False  # the math reference in fp32 means fp32
    cases = cp_block_cases(blocks.CUDA_KERNELS, args.device, seq=args.seq)
    chosen = {}
    for dtype in ("bfloat16", "float32"):
        for d in (64, 128):
            for rep in (1, 4):
                q = torch.empty(1, 8, 64, d, device=args.device, dtype=getattr(torch, dtype))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    name = blocks.select(q, q[:, :8 // rep]).name
                chosen[f"{dtype} d{d} rep{rep}"] = {
                    "kernel": name, "warnings": [str(w.message) for w in caught]}
    ran = [c for c in cases if c["status"] != "n/a"]
    res = {"ran": True, "device": torch.cuda.get_device_name(0), "seq": args.seq,
           "tolerance": CP_BLOCK_TOLERANCE, "cases": cases, "auto": chosen,
           "passed": sum(c["status"] == "pass" for c in ran), "checked": len(ran),
           # every dtype has a kernel that ran, and auto never fell back to the math path
           "pass": (all(c["status"] == "pass" for c in ran)
                    and {c["dtype"] for c in ran} == {"bfloat16", "float32"}
                    and all(v["kernel"] != "math" for v in chosen.values()))}
    _write(args.result, res)
    return 0 if res["pass"] else 1


# --------------------------------------------------------------------------------- doc_attention
# the samples of a document check: a 1-token document, documents longer and shorter than the
# window, a sample of one long document beside one of many short ones
DOC_LENGTHS = ((1, 300, 200, 523), (700, 5, 4, 3, 312))


def doc_attention_cases(device, dtypes=("bfloat16", "float32"), head_dims=(64, 128),
                        lengths=DOC_LENGTHS, heads=8, windows=(None, 7)):
    """megalite.masks.document_attention (--reset-attention-mask on one device) against one SDPA
    under the whole document mask in fp32 on the math backend, on the same inputs (rounded to
    the dtype), forward and backward, per dtype, head dim, GQA ratio (1 and 4) and window. On
    CUDA it takes torch's varlen kernel when that passes its self-check, else SDPA per
    document: each case names the path it took and the self-check's warning if any. The window
    is short, so a key too many or too few moves the output well past bf16's tolerance."""
    import warnings

    import numpy as np
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megalite import masks

    seq = sum(lengths[0])
    docs = masks.Documents.of(np.stack([np.repeat(np.arange(len(x)), x) for x in lengths]))
    docs, pos = docs.to(device), torch.arange(seq)
    cases, gen = [], torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes:
        for d in head_dims:
            for rep in (1, 4):
                for window in windows:
                    def rand(h):
                        return torch.randn(len(lengths), h, seq, d, device=device,
                                           generator=gen).to(getattr(torch, dtype))
                    q, do, k, v = rand(heads), rand(heads), rand(heads // rep), rand(heads // rep)
                    case = {"dtype": dtype, "head_dim": d, "rep": rep, "window": window}
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        fused = q.is_cuda and masks._varlen_ok(q, k, window)
                    case["path"] = "varlen" if fused else "sdpa per document"
                    case["warnings"] = [str(w.message) for w in caught]
                    try:
                        got = _attention_grads(masks.document_attention, q, k, v, do, docs,
                                               window=window, enable_gqa=rep > 1)
                    except Exception as ex:  # noqa: BLE001 - a kernel that fails is a failure
                        cases.append({**case, "status": "fail",
                                      "error": f"{type(ex).__name__}: {ex}"[:300]})
                        continue
                    with sdpa_kernel(SDPBackend.MATH):
                        ref = _attention_grads(
                            F.scaled_dot_product_attention, *(t.float() for t in (q, k, v, do)),
                            attn_mask=docs.mask(pos, pos, window), enable_gqa=rep > 1)
                    errs = {name: float((a.float() - b).abs().max() / b.abs().max())
                            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
                    worst = max(errs.values())
                    ok = worst <= CP_BLOCK_TOLERANCE.get(dtype, 1e-4)  # NaN fails too
                    cases.append({**case, "status": "pass" if ok else "fail", "max_error": worst,
                                  "errors": errs})
    return cases


def _attention_grads(attend, q, k, v, do, *args, **kw):
    """(out, dq, dk, dv) of ``attend(q, k, v, *args, **kw)`` under the output gradient ``do``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, *args, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


def cmd_doc_attention(args):
    """The CUDA document kernel (--reset-attention-mask: torch's varlen flash attention behind
    its self-check) against the exact masked SDPA, forward and backward, bf16 and fp32. Pass:
    every case within tolerance, and bf16 took the varlen kernel (fp32, which flash attention
    does not take, may run SDPA per document). Without CUDA: NOT_RUN."""
    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        _write(args.result, {"ran": False, "pass": False, "device": args.device,
                             "reason": "no CUDA device: the CUDA document kernel was not checked "
                                       "(the CPU path is tested by the test suite)"})
        return NOT_RUN
    torch.backends.cuda.matmul.allow_tf32 = False  # the math reference in fp32 means fp32
    cases = doc_attention_cases(args.device)
    res = {"ran": True, "device": torch.cuda.get_device_name(0), "lengths": DOC_LENGTHS,
           "tolerance": CP_BLOCK_TOLERANCE, "cases": cases,
           "passed": sum(c["status"] == "pass" for c in cases), "checked": len(cases),
           "pass": (all(c["status"] == "pass" for c in cases)
                    and all(c["path"] == "varlen" for c in cases if c["dtype"] == "bfloat16"))}
    _write(args.result, res)
    return 0 if res["pass"] else 1


# ------------------------------------------------------------------------------- attention_sinks
SINK_LAYOUTS = (("causal", None, False), ("window", 7, False), ("documents + window", 7, True))


def _sink_reference(q, k, v, sink, sees):
    """The definition, in fp32: softmax over the masked scores q k^T / sqrt(d) and one more
    column holding the head's sink logit (its value 0, so the column is dropped before P V)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~sees, float("-inf"))
    column = sink[:, None, None].expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], -1).softmax(-1)[..., :-1] @ v


def attention_sinks_cases(device, dtypes=("bfloat16", "float32"), head_dims=(64, 128),
                          lengths=DOC_LENGTHS, heads=8, layouts=SINK_LAYOUTS):
    """megalite.masks.sink_attention (GPT-OSS's sinks) against _sink_reference on the same inputs
    (rounded to the dtype): out, dq, dk, dv and the sink's gradient, per dtype, head dim, GQA
    ratio (1 and 4) and layout (plain causal, a window, documents ``lengths`` within a window).
    Each case names the block kernel it took: the one --cp-attention-kernel auto picks for a
    block under the kernel's own causal mask, masked(that one) under a window or documents. The
    sinks span -2 to 6, from heads they barely touch to heads they take most of the weight of."""
    import warnings

    import numpy as np

    from megalite import masks
    from megalite.context_parallel import blocks

    seq = sum(lengths[0])
    ids = np.stack([np.repeat(np.arange(len(x)), x) for x in lengths])
    pos = torch.arange(seq)
    cases, gen = [], torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes:
        sink = torch.linspace(-2, 6, heads, device=device).to(getattr(torch, dtype))
        for d in head_dims:
            for rep in (1, 4):
                for layout, window, packed in layouts:
                    def rand(h):
                        return torch.randn(len(lengths), h, seq, d, device=device,
                                           generator=gen).to(getattr(torch, dtype))
                    q, do, k, v = rand(heads), rand(heads), rand(heads // rep), rand(heads // rep)
                    docs = masks.Documents.of(ids).to(device) if packed else None
                    case = {"dtype": dtype, "head_dim": d, "rep": rep, "layout": layout}
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        chosen = blocks.select(q, k)
                    mask = masks.block(pos, pos, True, window, docs, q.device)
                    case["path"] = chosen.name if mask is None else \
                        f"{blocks.masked(chosen).name} under a mask"
                    case["warnings"] = [str(w.message) for w in caught]
                    try:
                        got = _rule_grads(lambda *t: masks.sink_attention(
                            *t, window=window, docs=docs), [q, k, v, sink], do)
                    except Exception as ex:  # noqa: BLE001 - a kernel that fails is a failure
                        cases.append({**case, "status": "fail",
                                      "error": f"{type(ex).__name__}: {ex}"[:300]})
                        continue
                    gap = pos[:, None] - pos[None, :]
                    sees = (gap >= 0) & (gap < (window or seq))
                    if packed:
                        doc = torch.from_numpy(ids)
                        sees = sees & (doc[:, None, :, None] == doc[:, None, None, :])
                    sees = sees.to(device)
                    ref = _rule_grads(lambda *t: _sink_reference(*t, sees),
                                      [t.float() for t in (q, k, v, sink)], do.float())
                    errs = {name: float((a.float() - b).abs().max() / b.abs().max())
                            for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), got, ref)}
                    worst = max(errs.values())
                    ok = worst <= CP_BLOCK_TOLERANCE.get(dtype, 1e-4)  # NaN fails too
                    cases.append({**case, "status": "pass" if ok else "fail", "max_error": worst,
                                  "errors": errs})
    return cases


def cmd_attention_sinks(args):
    """GPT-OSS's attention sinks on CUDA (masks.sink_attention: the CP block kernels, flash /
    efficient without a mask and MATH under one) against the softmax written out with the sink's
    column, forward and backward, bf16 and fp32. Pass: every case within tolerance. Without
    CUDA: NOT_RUN."""
    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        _write(args.result, {"ran": False, "pass": False, "device": args.device,
                             "reason": "no CUDA device: attention sinks on the CUDA kernels were "
                                       "not checked (the CPU path is tested by the test suite)"})
        return NOT_RUN
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in fp32 means fp32
    cases = attention_sinks_cases(args.device)
    res = {"ran": True, "device": torch.cuda.get_device_name(0), "lengths": DOC_LENGTHS,
           "tolerance": CP_BLOCK_TOLERANCE, "cases": cases,
           "passed": sum(c["status"] == "pass" for c in cases), "checked": len(cases),
           "pass": all(c["status"] == "pass" for c in cases)}
    _write(args.result, res)
    return 0 if res["pass"] else 1


# ------------------------------------------------------------------------------ linear_attention
LINEAR_TOLERANCE = {"float32": 2e-3, "bfloat16": 2e-2}  # models/linear_attention.py's self-check


def fla_rule(q, k, v, g, beta):
    """fla's chunk_gated_delta_rule on megalite's [b, h, s, d] layout (q arrives scaled)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, _ = chunk_gated_delta_rule(*(t.transpose(1, 2).contiguous() for t in (q, k, v, g, beta)),
                                  scale=1.0)
    return o.transpose(1, 2)


def linear_attention_cases(kernel, device, dtypes=("bfloat16", "float32"),
                           head_dims=(64, 128), seq=1000, heads=4):
    """``kernel(q, k, v, g, beta)`` against megalite's exact chunked rule
    (models/linear_attention.gated_delta_rule) in fp32 on the same inputs rounded to the dtype:
    the output and the gradients of q, k, v, g and beta relative to the reference's largest
    value, per dtype and head dim; ``seq`` not a multiple of the chunk (the padded tail)."""
    from megalite.models.linear_attention import gated_delta_rule, l2_normalize

    cases, gen = [], torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes:
        for d in head_dims:
            def rand(*shape):
                return torch.randn(2, heads, seq, *shape, device=device, generator=gen)
            q, k = (l2_normalize(rand(d)) for _ in range(2))
            v, do = rand(d), rand(d)
            g = -0.5 * torch.rand(2, heads, seq, device=device, generator=gen)
            beta = torch.rand(2, heads, seq, device=device, generator=gen)
            ins = [t.to(getattr(torch, dtype)) for t in (q * d ** -0.5, k, v)] + [g, beta]
            case = {"dtype": dtype, "head_dim": d}
            try:
                got = _rule_grads(kernel, ins, do)
            except Exception as ex:  # noqa: BLE001 - a kernel that fails is a failure
                cases.append({**case, "status": "fail",
                              "error": f"{type(ex).__name__}: {ex}"[:300]})
                continue
            ref = _rule_grads(gated_delta_rule, [t.float() for t in ins], do)
            errs = {name: float((a.float() - b).abs().max() / b.abs().max())
                    for name, a, b in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), got, ref)}
            worst = max(errs.values())
            ok = worst <= LINEAR_TOLERANCE[dtype]  # NaN fails too
            cases.append({**case, "status": "pass" if ok else "fail", "max_error": worst,
                          "errors": errs})
    return cases


def _rule_grads(rule, ins, do):
    ins = [t.detach().requires_grad_() for t in ins]
    out = rule(*ins)
    return (out.detach(), *torch.autograd.grad(out, ins, do.to(out.dtype)))


def cmd_linear_attention(args):
    """fla's chunk_gated_delta_rule (the CUDA kernel --linear-attention-freq layers take after
    their self-check) against megalite's torch rule on CUDA, forward and backward, bf16 and
    fp32. Pass: every case within tolerance. Without CUDA or without fla: NOT_RUN."""
    import importlib.util

    reason = None
    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        reason = "no CUDA device: the fla kernel was not checked (the torch rule is tested)"
    elif importlib.util.find_spec("fla") is None:
        reason = "fla is not installed (pip install megalite[fla]): nothing to check"
    if reason is not None:
        _write(args.result, {"ran": False, "pass": False, "device": args.device,
                             "reason": reason})
        return NOT_RUN
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in fp32 means fp32
    cases = linear_attention_cases(fla_rule, args.device)
    res = {"ran": True, "device": torch.cuda.get_device_name(0),
           "tolerance": LINEAR_TOLERANCE, "cases": cases,
           "passed": sum(c["status"] == "pass" for c in cases), "checked": len(cases),
           "pass": all(c["status"] == "pass" for c in cases)}
    _write(args.result, res)
    return 0 if res["pass"] else 1


# ----------------------------------------------------------------------------------------- syncs
def cmd_syncs(args):
    """Host synchronisations of pretrain.py (bf16, 5 iterations, --log-interval 4): megalite's
    own reads counted at dispatch (tests/host_reads.py) and, on CUDA, every synchronizing call
    torch.cuda.set_sync_debug_mode reports, torch's included. Pass: the steps between log lines
    (2, 3 and 4) make no read and no CUDA sync, and the log line's counts are the same at
    2 layers x 1 micro-batch and 8 layers x 8 micro-batches (docs/performance.md, "A step with
    no host read")."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests"))
    from host_reads import count_pretrain

    cuda = torch.device(args.device).type == "cuda"
    base = ["--device", args.device, "--mock-data", "--hidden-size", "256",
            "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "2",
            "--vocab-size", "1000", "--bf16", "--train-iters", "5", "--log-interval", "4",
            "--lr-warmup-iters", "1", "--eval-interval", "100000", "--eval-iters", "0"]
    res = {"device": args.device}

    def split(c):
        return (sum(n for k, n in c.items() if not k.startswith("cuda sync")),
                sum(n for k, n in c.items() if k.startswith("cuda sync")))

    for name, layers, gbs in (("small", 2, 2), ("large", 8, 16)):
        counts = count_pretrain(base + ["--num-layers", str(layers), "--global-batch-size",
                                        str(gbs)], cuda_syncs=cuda)
        # steps 2-4 (1 builds the optimizer state), then the log line at 4 with step 5
        steps, log = [split(c) for c in counts[1:4]], counts[4]
        res[name] = {"step_reads_and_syncs": steps, "megalite_reads": split(log)[0],
                     "cuda_syncs": split(log)[1], "where": {"steps": [dict(c) for c in
                                                                       counts[1:4]],
                                                             "log_line": dict(log)}}
    res["pass"] = (all(res[n]["step_reads_and_syncs"] == [(0, 0)] * 3 for n in ("small", "large"))
                   and all(res["small"][k] == res["large"][k]
                           for k in ("megalite_reads", "cuda_syncs")))
    _write(args.result, res)
    return 0 if res["pass"] else 1


# --------------------------------------------------------------------------------------- offload
def _offload_run(device, offload: bool, iters: int = 3):
    """Device bytes held after the steps (model states) and the peak, a bf16 model at ZeRO 0,
    with or without --optimizer-cpu-offload (docs/offload.md); and the last step's weights."""
    from megalite.config import OptimizerConfig
    from megalite.distributed.ddp import wrap_chunks
    from megalite.models import GPTModel
    from megalite.optimizer import build_optimizer
    from megalite.parallel_state import ParallelState

    ps = ParallelState(device=torch.device(device))
    cfg = _model_config("llama", "bfloat16")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opt_cfg = OptimizerConfig(optimizer_cpu_offload=offload).validate()
    model = GPTModel(cfg, ps, seed=1, device=torch.device(device))
    chunks, _, _ = wrap_chunks([model], opt_cfg, ps)
    opt = build_optimizer(chunks, opt_cfg, ps)
    g = torch.Generator().manual_seed(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        ids = torch.randint(0, cfg.vocab_size, (2, 129), generator=g).to(device)
        opt.zero_grad()
        chunks[0](ids[:, :-1], labels=ids[:, 1:]).float().mean().backward()
        chunks[0].finish_grad_sync()
        opt.step()
    torch.cuda.synchronize()
    return {"held_bytes": torch.cuda.memory_allocated() - base,
            "peak_bytes": torch.cuda.max_memory_allocated() - base,
            "step_s": (time.perf_counter() - start) / iters,
            "elements": sum(p.numel() for p in opt.model_params)}, \
        torch.cat([p.detach().float().reshape(-1).cpu() for p in opt.model_params])


def cmd_offload(args):
    """Device memory with and without --optimizer-cpu-offload (f = 1, ZeRO 0, bf16): the Adam
    moments (8 bytes per parameter) leave the device, the weights stay as without it. Pass: the
    held bytes drop by at least 90% of 8 bytes per parameter and the weights agree (bf16, 1e-2).
    Without CUDA: NOT_RUN."""
    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        _write(args.result, {"ran": False, "pass": False, "device": args.device,
                             "reason": "no CUDA device: offload's device memory not measured"})
        return NOT_RUN
    (off, w_off), (on, w_on) = (_offload_run(args.device, o) for o in (False, True))
    saved = off["held_bytes"] - on["held_bytes"]
    diff = ((w_on - w_off).abs().max() / w_off.abs().max()).item()
    res = {"ran": True, "device": torch.cuda.get_device_name(0), "without": off, "with": on,
           "saved_bytes": saved, "expected_bytes": 8 * off["elements"], "weights_rel": diff,
           "pass": saved >= 0.9 * 8 * off["elements"] and diff <= 1e-2}
    _write(args.result, res)
    return 0 if res["pass"] else 1


# ------------------------------------------------------------------------------------- summarize
def _train_stats(path):
    recs = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    train = [r for r in recs if r.get("split") == "train"]
    timed = train[1:] or train  # the first logged interval holds warm-up and compilation
    if not timed:
        return {"records": 0}
    def med(k):  # None when no record has it (MFU on a GPU missing from the peak table)
        vals = [r[k] for r in timed if r.get(k) is not None]
        return statistics.median(vals) if vals else None
    return {"records": len(train), "iteration_time_ms": med("iteration_time_ms"),
            "tokens_per_sec": med("tokens_per_sec"), "tflops_per_device": med("tflops_per_device"),
            "mfu": med("mfu"), "peak_memory_gib": max(r["peak_memory_bytes"] for r in timed) / 2 ** 30,
            "lm_loss_first": train[0]["lm_loss"], "lm_loss_last": train[-1]["lm_loss"]}


def cmd_summarize(args):
    steps = []
    for line in open(os.path.join(args.work, "steps.tsv")):
        name, status, rc, secs, note = line.rstrip("\n").split("\t")
        step = {"step": name, "status": status, "rc": int(rc), "seconds": float(secs), "note": note}
        result = os.path.join(args.work, f"{name}.json")
        try:
            step["result"] = json.load(open(result))
        except (OSError, ValueError):
            pass
        if name.startswith("train_") and status == "pass":
            step["result"] = _train_stats(os.path.join(args.work, f"{name}.jsonl"))
            if not step["result"].get("records"):
                step["status"], step["note"] = "fail", "no train records in metrics file; " + note
        steps.append(step)
    env = next((s.get("result", {}) for s in steps if s["step"] == "env"), {})
    summary = {"mode": args.mode, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "env": env,
               # every step that ran passed, and one did: a check of nothing is no pass
               "steps": steps, "all_pass": (all(s["status"] in ("pass", "skip") for s in steps)
                                            and any(s["status"] == "pass" for s in steps)),
               "not_run": [s["step"] for s in steps if s["status"] == "skip"]}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)

    lines = [f"gpu_check {summary['time']}  mode: {args.mode}",
             f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}) | device: "
             f"{env.get('device_name', 'none')} | NCCL available: {env.get('nccl_available')} "
             f"{env.get('nccl_version', '')} | bf16 matmul measured: "
             f"{env.get('bf16_matmul_tflops_measured', '-')} TFLOP/s | 1-rank NCCL all-reduce: "
             f"{env.get('nccl_1rank_all_reduce', '-')}", ""]
    if args.mode != "gpu":
        lines.insert(1, "DRY RUN (no CUDA device): correctness and train_* ran as tiny CPU stand-ins; "
                        "no number below is a GPU measurement")
    lines.append(f"{'step':<22} {'status':<8} {'s':>6}  detail")
    for s in steps:
        r, detail = s.get("result", {}), s["note"]
        if "tokens_per_sec" in r:
            mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            detail = (f"{r['tokens_per_sec']:,.0f} tok/s  {r['tflops_per_device']:.1f} TFLOP/s  "
                      f"MFU {mfu}  {r['iteration_time_ms']:.1f} ms/it  "
                      f"peak {r['peak_memory_gib']:.2f} GiB  loss {r['lm_loss_first']:.3f}->"
                      f"{r['lm_loss_last']:.3f}  {detail}")
        elif s["step"] == "correctness" and "gpt2_fp32" in r:
            detail = "; ".join(
                f"{k}: logits {r[k].get('logits_max_abs', r[k].get('logits_rel')):.1e} "
                f"grad {r[k].get('grad_max_abs', r[k].get('grad_rel_median')):.1e}"
                for k in ("gpt2_fp32", "gpt2_bf16", "llama_fp32", "llama_bf16")) + f"  {detail}"
        elif s["step"] in ("cp_blocks", "doc_attention", "attention_sinks", "linear_attention",
                           "offload") and r.get("ran") is False:
            detail = f"NOT RUN: {r['reason']}"
        elif s["step"] in ("doc_attention", "attention_sinks") and "cases" in r:
            paths = {dt: sorted({c["path"] for c in r["cases"] if c["dtype"] == dt})
                     for dt in ("bfloat16", "float32")}
            detail = (f"{r['passed']}/{r['checked']} cases pass; worst error "
                      f"{max(c.get('max_error', float('inf')) for c in r['cases']):.1e}; "
                      + ", ".join(f"{dt}: {'/'.join(p)}" for dt, p in paths.items())
                      + f"  {detail}")
        elif s["step"] == "offload" and "saved_bytes" in r:
            detail = (f"device {r['saved_bytes'] / 2**20:.1f} MiB less (Adam moments: "
                      f"{r['expected_bytes'] / 2**20:.1f}); weights {r['weights_rel']:.1e}; step "
                      f"{r['without']['step_s'] * 1e3:.0f} -> {r['with']['step_s'] * 1e3:.0f} ms"
                      f"  {detail}")
        elif s["step"] == "linear_attention" and "cases" in r:
            detail = (f"{r['passed']}/{r['checked']} cases pass; worst error "
                      f"{max(c.get('max_error', float('inf')) for c in r['cases']):.1e}  {detail}")
        elif s["step"] == "cp_blocks" and "cases" in r:
            worst = {dt: max((c.get("max_error", float("inf")) for c in r["cases"]
                              if c["dtype"] == dt and c["status"] != "n/a"), default=None)
                     for dt in ("bfloat16", "float32")}
            detail = (f"{r['passed']}/{r['checked']} kernel cases pass; worst error "
                      + ", ".join(f"{dt} {'-' if e is None else f'{e:.1e}'}"
                                  for dt, e in worst.items())
                      + "; auto: " + ", ".join(sorted({v["kernel"] for v in r["auto"].values()}))
                      + f"  {detail}")
        elif s["step"] == "host_syncs" and "small" in r:
            detail = "; ".join(
                f"{k}: steps {sum(a + b for a, b in r[k]['step_reads_and_syncs'])} reads+syncs, "
                f"log line {r[k]['megalite_reads']} megalite reads, {r[k]['cuda_syncs']} CUDA syncs"
                for k in ("small", "large")) + f"  {detail}"
        elif "megalite" in r and "hf" in r:
            detail = (f"megalite {r['megalite']['tokens_per_s']:,.0f} tok/s, HF {r['hf']['tokens_per_s']:,.0f}"
                      f" tok/s, per-round ratio {r['paired_ratio_median']:.2f}x, {r['threads']} threads"
                      f"  {detail}")
        lines.append(f"{s['step']:<22} {s['status']:<8} {s['seconds']:>6.1f}  {detail}")
    not_run = f" (not run: {', '.join(summary['not_run'])})" if summary["not_run"] else ""
    if not any(s["status"] == "pass" for s in steps):
        not_run = " (no step ran and passed" + (f"; {not_run[2:]}" if not_run else ")")
    lines.append(f"\nALL PASS: {summary['all_pass']}{not_run}")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--result", required=True)
    c = sub.add_parser("correctness")
    c.add_argument("--device", default="cuda")
    c.add_argument("--result", required=True)
    b = sub.add_parser("cp_blocks")
    b.add_argument("--device", default="cuda")
    b.add_argument("--seq", type=int, default=512, help="keys of a square block")
    b.add_argument("--result", required=True)
    a = sub.add_parser("doc_attention")
    a.add_argument("--device", default="cuda")
    a.add_argument("--result", required=True)
    at = sub.add_parser("attention_sinks")
    at.add_argument("--device", default="cuda")
    at.add_argument("--result", required=True)
    la = sub.add_parser("linear_attention")
    la.add_argument("--device", default="cuda")
    la.add_argument("--result", required=True)
    y = sub.add_parser("syncs")
    y.add_argument("--device", default="cuda")
    y.add_argument("--result", required=True)
    o = sub.add_parser("offload")
    o.add_argument("--device", default="cuda")
    o.add_argument("--result", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--work", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--mode", default="gpu")
    args = p.parse_args(argv)
    return {"env": cmd_env, "correctness": cmd_correctness, "cp_blocks": cmd_cp_blocks,
            "doc_attention": cmd_doc_attention, "attention_sinks": cmd_attention_sinks,
            "linear_attention": cmd_linear_attention,
            "syncs": cmd_syncs, "offload": cmd_offload,
            "summarize": cmd_summarize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
