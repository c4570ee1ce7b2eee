"""What the tests share and are not tests: the one launcher of every process a test starts, NCCL's
point-to-point rules for gloo, readers of what a job leaves behind, small models and checks."""
