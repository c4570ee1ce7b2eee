"""What a user starts jobs with, run from the repository root; it imports spmdsplit, which never
imports it. `python -m launch.slurm` submits a training job to Slurm through submitit (one Slurm
task per rank); `launch/spmdsplit.sbatch` is the same job as a plain sbatch script;
`launch/torchrun_2x8.sh` starts the job on 2 nodes x 8 GPUs with torchrun."""
