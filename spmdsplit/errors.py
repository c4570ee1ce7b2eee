"""The error a user sees for a config that cannot work: one line naming the key and what was
expected, raised on every rank before the first collective and printed without a traceback
(spmdsplit/train.py main). Its own module, importing nothing, so that the schema
(spmdsplit/config.py), the start-up checks (spmdsplit/preflight.py) and the parts that check
their own keys (tools, custom rewards, vLLM) all raise it without importing one another.

The other errors train.py prints the same way stay beside what raises them: PlacementError
(spmdsplit/placement.py), DataError (spmdsplit/data/parquet.py), CheckpointError
(spmdsplit/checkpoint_files.py); none of those modules imports the configuration.
"""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and what was expected."""
