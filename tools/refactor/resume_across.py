"""A refactor's other promise besides tools.refactor.preset_fingerprint's: a checkpoint written by
the code before it resumes in the code after it. In each layout the old checkout runs 4 steps
(checkpoints at 2 and 4), the new one resumes from step 2; its steps 3-4 must log what the old
uninterrupted run logged (bit for bit, timings aside); continuous generation's, what the old code's
own resume of it logs (its engine counters count the validation run before the checkpoint only when
uninterrupted).

    python -m tools.refactor.resume_across OLD_CHECKOUT NEW_CHECKOUT     # from either checkout's root
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from tools.jobs import free_port, read_scalars

CONT = ["rollout.continuous=true", "rollout.version_every_engine_steps=6", "rollout.hf_step_tokens=1",
        "data.max_response_length=24", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8"]
JOBS = [("split", "default.yaml", 4, []),
        ("rollout pool, staleness 1", "grpo_rollout_actor.yaml", 2, ["rollout.staleness=1"]),
        ("continuous, fixed schedule", "grpo_rollout_actor.yaml", 2, CONT)]


def job(checkout: str, nproc: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), "-m", "spmdsplit.train", *args]
    r = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the checkout before the change (writes the checkpoints)")
    parser.add_argument("new", help="the checkout after it (resumes them)")
    args = parser.parse_args()
    old_dir, new_dir = os.path.abspath(args.old), os.path.abspath(args.new)
    sys.exit(compare(old_dir, new_dir))


def compare(before: str, after: str) -> int:
    bad = 0
    for name, preset, nproc, extra in JOBS:
        d = tempfile.mkdtemp()
        common = ["--config", f"{before}/configs/{preset}", *extra, "trainer.total_steps=4", "trainer.save_freq=2",
                  "trainer.val_freq=2", "trainer.progress_bar=false", "trainer.output_dir=", "trainer.timeline="]
        job(before, nproc, [*common, f"trainer.default_local_dir={d}/ckpt", f"trainer.log_dir={d}/old", "trainer.resume=disable"])
        job(after, nproc, [*common, f"trainer.default_local_dir={d}/ckpt2", f"trainer.log_dir={d}/new",
                         f"trainer.resume={d}/ckpt/global_step_2"])
        old, new = read_scalars(f"{d}/old"), read_scalars(f"{d}/new")
        if name.startswith("continuous"):  # its counters of engine work differ after any resume: old code resumes too
            job(before, nproc, [*common, f"trainer.default_local_dir={d}/ckpt3", f"trainer.log_dir={d}/oldres",
                             f"trainer.resume={d}/ckpt/global_step_2"])
            old = read_scalars(f"{d}/oldres")
        keep = lambda t: not t.startswith(("timing_s/", "perf/", "memory"))
        old = {t: {s: v for s, v in p.items() if s > 2} for t, p in old.items() if keep(t)}
        new = {t: p for t, p in new.items() if keep(t)}
        diffs = [t for t in sorted(set(old) | set(new)) if old.get(t) != new.get(t)]
        print(f"{name}: {len(old)} scalars of steps 3-4, " + ("equal" if not diffs else f"{len(diffs)} differ: {diffs[:5]}"),
              flush=True)
        bad += bool(diffs)
        shutil.rmtree(d)
    return 1 if bad else 0


if __name__ == "__main__":
    main()
