"""What a user starts jobs with, run from the repository root; it imports spmdsplit, which never
imports it. `python -m launch.slurm` submits a training job to Slurm through submitit (one Slurm
task per rank); `launch/spmdsplit.sbatch` is the same job as a plain sbatch script."""
