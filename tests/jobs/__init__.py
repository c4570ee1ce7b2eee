"""Job scripts the tests start as ranks (`torchrun ... tests/jobs/<name>.py key=value ...`): the real
entry point with a fault, a stall or a probe planted (each file says what and for which test)."""
