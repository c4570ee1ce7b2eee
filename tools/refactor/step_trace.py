"""What one training step passes through: `python -m tools.refactor.step_trace [--nproc N] [--step S] [key=value ...]`

Runs `spmdsplit.train` under torchrun (the default job: 4 ranks, split), and on every rank traces the
main thread's Python calls during step S's `train_step` (sys.setprofile). It prints the spmdsplit
files whose code ran on some rank, and for a few landmarks (building the step's prompts, the
policy's weights into the engine, the advantages, the policy loss) the fewest calls from
`train_step` down to them: the hops a reader follows with go-to-definition. Frames outside spmdsplit
(torch, contextlib, a generator's `next`) are not counted as hops; threads other than the main one
(senders, the failure watch) are not traced.

A structure check for refactors: the numbers before and after a change, side by side, from the same
command in each checkout (one from before tools/ was sorted into folders by job has it as
tools.step_trace).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# A landmark: a name to find (a function's qualified name), and what reaching it means.
LANDMARKS = {
    "collate_prompts": "the step's prompts tokenised",
    "HFEngine.load_weights": "the policy's weights into the engine",
    "compute_advantage": "the advantages",
    "compute_policy_loss": "the policy loss",
}
ENTRY = "train_step"


def trace_rank(out_dir: str, step: int, argv: list[str]) -> int:
    """On one rank: the job, with `train_step` of step `step` traced."""
    import spmdsplit
    from spmdsplit import train, trainer

    package = os.path.dirname(os.path.abspath(spmdsplit.__file__)) + os.sep
    files: set[str] = set()
    hops: dict[str, list[str]] = {}  # a function: the shortest chain of calls from train_step to it

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(package):
            return
        name = frame.f_code.co_filename[len(package):]
        files.add(name)
        chain, f = [], frame
        while f is not None and f.f_code.co_name != ENTRY:
            if f.f_code.co_filename.startswith(package):
                chain.append(f.f_code.co_qualname)
            f = f.f_back
        key = f"{name}:{frame.f_code.co_qualname}"
        if f is not None and (key not in hops or len(chain) < len(hops[key])):
            hops[key] = chain[::-1]  # train_step's callee first

    original = trainer.Trainer.train_step

    def traced(self, s: int, *args, **kwargs):
        if s != step:
            return original(self, s, *args, **kwargs)
        sys.setprofile(profile)
        try:
            return original(self, s, *args, **kwargs)
        finally:
            sys.setprofile(None)
            with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
                json.dump({"files": sorted(files), "hops": hops}, f)

    trainer.Trainer.train_step = traced
    return train.main(argv)


def summarize(out_dir: str) -> dict:
    ranks = [json.load(open(os.path.join(out_dir, n))) for n in sorted(os.listdir(out_dir)) if n.endswith(".json")]
    files = sorted(set().union(*(r["files"] for r in ranks)))
    hops: dict[str, list[str]] = {}
    for r in ranks:
        for key, chain in r["hops"].items():
            if key not in hops or len(chain) < len(hops[key]):
                hops[key] = chain
    landmarks = {}
    for name, meaning in LANDMARKS.items():
        found = sorted((len(c), k, c) for k, c in hops.items() if k.split(":", 1)[1] == name)
        landmarks[name] = {"meaning": meaning, "hops": found[0][0] if found else None,
                           "where": found[0][1] if found else None, "chain": found[0][2] if found else []}
    return {"ranks": len(ranks), "files": files, "landmarks": landmarks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--rank-side", help=argparse.SUPPRESS)  # set by the tool for its ranks
    args, overrides = parser.parse_known_args()
    if args.rank_side:
        sys.exit(trace_rank(args.rank_side, args.step, overrides))
    from tools.jobs import free_port

    with tempfile.TemporaryDirectory() as out:
        job = [*overrides, f"trainer.total_steps={args.step}", "trainer.progress_bar=false", "trainer.output_dir=",
               "trainer.timeline=", f"trainer.log_dir={out}/logs", f"trainer.default_local_dir={out}/ckpt",
               "trainer.save_freq=-1", "trainer.resume=disable"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--master-port",
               str(free_port()), "-m", "tools.refactor.step_trace", "--step", str(args.step), "--rank-side", out, *job]
        os.makedirs(out, exist_ok=True)
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode != 0:
            sys.exit(f"the job failed:\n{r.stderr[-3000:]}")
        summary = summarize(out)
    print(f"step {args.step} on {summary['ranks']} ranks: {len(summary['files'])} spmdsplit files ran")
    for name in summary["files"]:
        print(f"  {name}")
    print(f"fewest calls from {ENTRY} (main thread):")
    for name, mark in summary["landmarks"].items():
        print(f"  {mark['hops'] if mark['hops'] is not None else '-':>2}  {mark['meaning']} "
              f"({mark['where'] or name + ': not reached'})")
        if mark["chain"]:
            print(f"      {ENTRY} -> {' -> '.join(mark['chain'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
