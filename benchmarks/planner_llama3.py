"""The planner's time model against the Llama 3 405B rows (Llama 3 paper, Table 4).

    python benchmarks/planner_llama3.py [--rank]

Runs tools/plan.py --json with TP 8, PP 16 and the row's CP pinned (the rest searched: schedule,
virtual stages, ZeRO, SP, recompute, micro-batch) for the three published rows of the 405B model
(126 layers, hidden 16384, FFN 53248, 128 heads, 8 K/V heads, vocab 128256, 16M tokens per batch,
H100, bf16) and prints the predicted model TFLOP/s per GPU under both attention-FLOP conventions:
"full" (megalite.logging, Megatron-LM: every query against all s keys) and "causal" (half of
that attention work). The planner needs PP to divide the layers and the 405B's 126 do not divide
into 16 stages (Meta's first and last stages hold one layer fewer, in place of the embedding and
the loss head), so the layout is planned at 128 layers (16 x 8: the stage time of Meta's
pipeline) and the step's model FLOPs are those of the 126-layer model.

``--rank``: where the published layout (TP8 PP16 CP16 all-gather, best variant) places in the
planner's search at 131,072 tokens on 16,384 GPUs, with TP 8 pinned (and ``--pin`` flags, e.g.
``--pin --micro-batch-size 1 --sequence-parallel`` for a faster search).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODEL = ["--hidden-size", "16384", "--ffn-hidden-size", "53248", "--num-attention-heads", "128",
         "--group-query-attention", "--num-query-groups", "8", "--vocab-size", "128256",
         "--make-vocab-size-divisible-by", "128", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--bf16", "--gpu", "H100-80GB", "--gpus-per-node", "8",
         # what the report describes of its stack (section 3.3.2): the embedding and the loss in
         # a layer's slot of the pipeline split, and a fused implementation's activations
         "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
         "--activation-model", "fused"]
ROWS = [  # tokens, global batch (16M tokens), GPUs, CP, published TFLOP/s per GPU
    (8192, 2048, 8192, 1, 430), (8192, 2048, 16384, 1, 400), (131072, 128, 16384, 16, 380)]


def plan_json(seq, gbs, gpus, pinned, top=1):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--num-layers", "126"] \
        + MODEL + ["--seq-length", str(seq), "--global-batch-size", str(gbs), "--num-gpus",
                   str(gpus), "--json", "--top", str(top)] + pinned
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout)["layouts"], " ".join(["python tools/plan.py"] + cmd[2:])


def model_flops(seq):
    """(full, causal) model FLOPs of one 126-layer sequence."""
    from megalite.config import ModelConfig
    from megalite.logging import attention_flops, model_flops_per_sequence

    cfg = ModelConfig(num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                      num_attention_heads=128, num_query_groups=8, swiglu=True,
                      vocab_size=128256, seq_length=seq)
    full = model_flops_per_sequence(cfg)
    return full, full - attention_flops(cfg) / 2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", action="store_true")
    p.add_argument("--pin", nargs="*", default=[], help="--rank: more plan.py flags to pin")
    a = p.parse_args(argv)
    print("| tokens | GPUs | layout (planner's best with TP8 PP16 CP pinned) | step s | "
          "TFLOP/s full | TFLOP/s causal | published |\n|---|---|---|---|---|---|---|")
    got = {}
    for seq, gbs, gpus, cp, pub in ROWS:
        pin = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
               "--context-parallel-size", str(cp)] + (["--cp-comm-type", "allgather"] * (cp > 1))
        (best,), cmd = plan_json(seq, gbs, gpus, pin)
        step = best["step_time_s"]
        full, causal = (f * gbs / gpus / step / 1e12 for f in model_flops(seq))
        got[(seq, gpus)] = (full, causal)
        lay = (f"{best['pipeline_schedule']} v{best['virtual_pipeline_model_parallel_size']} "
               f"ZeRO{best['zero_stage']} SP{int(best['sequence_parallel'])} "
               f"mb{best['micro_batch_size']} recompute {best['recompute_granularity']}")
        print(f"| {seq} | {gpus} | CP{cp} {lay} | {step:.2f} | {full:.0f} | {causal:.0f} | "
              f"{pub} |", flush=True)
        print(f"<!-- {cmd} -->")
    f1, c1 = got[(8192, 16384)]
    f16, c16 = got[(131072, 16384)]
    print(f"\nCP16 at 131k / CP1 at 8k, 16,384 GPUs: predicted {f16 / f1:.3f} (full), "
          f"{c16 / c1:.3f} (causal); published 380/400 = {380 / 400:.3f}")
    if a.rank:
        seq, gbs, gpus = 131072, 128, 16384
        pin = ["--tensor-model-parallel-size", "8"] + a.pin
        lays, cmd = plan_json(seq, gbs, gpus, pin, top=100000)
        fits = [x for x in lays if x["fits"]]
        firsts = {}  # best variant of each (PP, CP, type)
        for i, x in enumerate(fits):
            firsts.setdefault((x["pipeline_model_parallel_size"], x["context_parallel_size"],
                               x["cp_comm_type"]), (i + 1, x))
        order = sorted(firsts.items(), key=lambda kv: kv[1][0])
        pos = [k for k, _ in order].index((16, 16, "allgather")) + 1
        print(f"\n{cmd}\n{len(fits)} layouts fit; by (PP, CP, type), best variant each, the "
              f"published TP8 PP16 CP16 allgather ranks {pos} of {len(order)} "
              f"(layout rank {firsts[(16, 16, 'allgather')][0]})")
        for k, (i, x) in order[:8]:
            print(f"  {i:6d} PP{k[0]} CP{k[1]} {k[2]} {x['pipeline_schedule']} "
                  f"v{x['virtual_pipeline_model_parallel_size']} ZeRO{x['zero_stage']} "
                  f"recompute {x['recompute_granularity']}: {x['step_time_s']:.2f} s")


if __name__ == "__main__":
    main()
