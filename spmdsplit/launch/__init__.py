"""Launchers: `python -m spmdsplit.launch.slurm` submits a training job to Slurm through submitit
(one Slurm task per rank); `spmdsplit/launch/spmdsplit.sbatch` is the same job as a plain sbatch script."""
