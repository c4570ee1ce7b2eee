"""The config (spmdsplit/config.py) and the command line's early failures (spmdsplit/train.py)."""

import glob
import os
import select
import socket
import subprocess
import time

import pytest
from omegaconf import OmegaConf

from spmdsplit.config import load_config, to_yaml
from spmdsplit.errors import ConfigError
from spmdsplit.preflight import check_against_pools, check_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def error_of(*overrides, config_file=None):
    """The one line that stops a job with this config before its world forms: from loading it
    (a key alone), or from preflight's checks of the config alone (keys together, registered names)."""
    with pytest.raises(ConfigError) as e:
        check_config(load_config(config_file, list(overrides)))
    return str(e.value)


# --------------------------------------------------------------------------- load_config


def test_defaults_load_and_overrides_apply():
    cfg = load_config(None, ["trainer.total_steps=7", "actor.optim.lr=0.5", "placement.pools=[3,1]"])
    assert cfg.trainer.total_steps == 7 and isinstance(cfg.trainer.total_steps, int)
    assert cfg.actor.optim.lr == 0.5
    assert list(cfg.placement.pools) == [3, 1]
    assert cfg.critic.optim.lr == load_config().critic.optim.lr  # nothing else moved


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.totl_steps=3", "trainer.totl_steps"),
        ("algorithm.kl_ctrl.kl_cof=0.1", "algorithm.kl_ctrl.kl_cof"),
        ("actor.optim.learning_rate=0.1", "actor.optim.learning_rate"),
        ("trainr.total_steps=3", "trainr"),  # a typo in the section itself names the section
    ],
)
def test_unknown_key_names_the_full_key(override, key):
    msg = error_of("trainer.total_steps=5", override)
    assert key in msg


def test_unknown_key_suggests_the_close_one():
    assert "total_steps" in error_of("trainer.totl_steps=3")


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.total_steps=abc", "trainer.total_steps"),
        ("actor.optim.lr=fast", "actor.optim.lr"),
        ("trainer.progress_bar=maybe", "trainer.progress_bar"),
        ("data.train_batch_size=1.5", "data.train_batch_size"),
        ("trainer.total_steps=", "trainer.total_steps"),  # empty is a string, not an int
    ],
)
def test_wrong_type_names_the_key(override, key):
    msg = error_of(override)
    assert key in msg
    assert override.split("=", 1)[1] in msg or "''" in msg


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("placement.mode=halves", "placement.mode", ["split", "colocate", "custom"]),
        ("data.task=sort", "data.task", ["repeat", "count", "copy", "reverse"]),
        ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type", ["fixed", "adaptive"]),
        ("model.dtype=fp16", "model.dtype", ["auto", "float32", "bfloat16"]),
        ("algorithm.rollout_correction.rollout_is=seq", "algorithm.rollout_correction.rollout_is",
         ["None", "token", "sequence"]),
    ],
)
def test_bad_choice_lists_the_allowed_values(override, key, allowed):
    msg = error_of(override)
    assert key in msg and override.split("=")[1] in msg
    for value in allowed:
        assert value in msg, value


def test_rollout_correction_keys_are_verls_and_checked_on_one_line():
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=sequence"]).algorithm.rollout_correction
    assert (cfg.rollout_is, cfg.rollout_is_threshold, cfg.bypass_mode, cfg.loss_type) == ("sequence", 2.0, False, "ppo_clip")
    assert load_config(None, []).algorithm.rollout_correction.rollout_is is None  # verl's default: off
    for override in ("algorithm.rollout_correction.rollout_is_threshold=0", "algorithm.rollout_correction.loss_type=reinforce"):
        msg = error_of(override)
        assert msg.startswith(override.split("=")[0] + "=") and "\n" not in msg, msg


def test_an_unknown_logger_is_one_line_naming_trainer_logger():
    msg = error_of("trainer.logger=[console,neptune]")
    assert "\n" not in msg and msg.startswith("trainer.logger=") and "'neptune'" in msg
    for name in ("console", "tensorboard", "wandb", "mlflow"):
        assert name in msg


def test_a_chosen_logger_that_is_not_installed_is_named_with_its_extra(monkeypatch):
    import importlib.util

    from spmdsplit.sinks import missing_logger

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert missing_logger(["console", "tensorboard"]) is None
    assert missing_logger(["console", "mlflow"]) == 'trainer.logger: mlflow is not installed (pip install -e ".[mlflow]")'


@pytest.mark.parametrize(
    "override",
    ["trainer.total_steps=0", "data.train_batch_size=-8", "data.max_response_length=0",
     "actor.ppo_micro_batch_size_per_gpu=0", "critic.ppo_epochs=-1", "rollout.temperature=0",
     "actor.ppo_max_token_len_per_gpu=0", "ref.log_prob_max_token_len_per_gpu=0",
     "reward.model.forward_max_token_len_per_gpu=-1"],
)
def test_non_positive_values_are_rejected(override):
    key = override.split("=")[0]
    msg = error_of(override)
    assert key in msg and "positive" in msg


def test_other_range_checks():
    assert "rollout.top_p" in error_of("rollout.top_p=0")
    assert "rollout.top_p" in error_of("rollout.top_p=1.5")
    load_config(None, ["rollout.top_p=1.0"])
    assert "actor.clip_ratio_c" in error_of("actor.clip_ratio_c=1.0")
    assert "actor.ppo_mini_batch_size" in error_of("actor.ppo_mini_batch_size=48")  # 48 does not divide 128
    assert "critic.ppo_mini_batch_size" in error_of("critic.ppo_mini_batch_size=100")
    assert "placement.pools" in error_of("placement.mode=custom")  # custom needs two sizes
    load_config(None, ["placement.mode=custom", "placement.pools=[3,1]"])
    assert "only rollout.name=vllm" in error_of("rollout.tensor_model_parallel_size=2")  # HF generate has no TP


def test_profile_steps_are_consecutive_steps():
    assert load_config(None, ["trainer.profile_steps=[2,3]"]).trainer.profile_steps == [2, 3]
    assert load_config(None, []).trainer.profile_steps == []  # off
    for bad in ("[2,4]", "[3,2]", "[0]"):
        msg = error_of(f"trainer.profile_steps={bad}")
        assert msg.startswith("trainer.profile_steps=") and "consecutive steps" in msg and "\n" not in msg


def test_override_without_equals_is_an_error():
    assert "key=value" in error_of("trainer.total_steps")


def test_key_equals_nothing_means_the_empty_string():
    cfg = load_config(None, ["model.path=", "trainer.timeline=", "trainer.output_dir="])
    assert cfg.model.path == "" and cfg.trainer.timeline == "" and cfg.trainer.output_dir == ""
    assert cfg.trainer.timeline is not None


def test_yaml_then_overrides_precedence(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text(
        "trainer:\n  total_steps: 11\n  seed: 5\n"
        "data:\n  train_batch_size: 64\n"
        "actor:\n  optim:\n    lr: 0.25\n"
    )
    cfg = load_config(str(path), ["trainer.total_steps=7", "actor.optim.lr=0.5"])
    assert cfg.trainer.total_steps == 7  # override beats YAML
    assert cfg.actor.optim.lr == 0.5
    assert cfg.trainer.seed == 5  # YAML beats the schema default
    assert cfg.data.train_batch_size == 64
    assert cfg.data.max_response_length == 6  # untouched: schema default
    # The embedded preset's warmup (model.path is empty) survives a partial optim block.
    assert cfg.actor.optim.lr_warmup_steps == load_config().actor.optim.lr_warmup_steps > 0
    cfg = load_config(str(path))
    assert cfg.trainer.total_steps == 11 and cfg.actor.optim.lr == 0.25


def test_yaml_with_an_unknown_key_names_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  total_stepz: 3\n")
    assert "trainer.total_stepz" in error_of(config_file=str(path))


def test_yaml_with_a_wrong_type_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  train_batch_size: lots\n")
    assert "data.train_batch_size" in error_of(config_file=str(path))


def test_missing_yaml_file_is_a_config_error(tmp_path):
    assert "no such file" in error_of(config_file=str(tmp_path / "absent.yaml"))


def test_to_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["trainer.total_steps=9", "placement.mode=colocate", "model.path="])
    path = tmp_path / "dump.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)) == cfg


PRESETS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")) + glob.glob(os.path.join(REPO, "configs", "*.yml")))


@pytest.mark.skipif(not PRESETS, reason="configs/ has no YAML presets")
@pytest.mark.parametrize("preset", PRESETS or [None], ids=lambda p: os.path.basename(p) if p else "none")
def test_every_preset_loads_against_the_schema(preset):
    cfg = load_config(preset)
    assert cfg.trainer.total_steps > 0


# --------------------------------------------------------------------------- check_against_pools


def pools_error(actor, critic, *overrides):
    cfg = load_config(None, list(overrides))
    with pytest.raises(ConfigError) as e:
        check_against_pools(cfg, {"actor": actor, "critic": critic})
    return str(e.value)


def test_batch_not_divisible_by_a_pool_size():
    msg = pools_error(3, 1)  # 128 prompts over 3 actor ranks
    assert "data.train_batch_size=128" in msg and "actor" in msg and "3" in msg
    msg = pools_error(2, 3, "data.train_batch_size=64")
    assert "data.train_batch_size=64" in msg and "critic" in msg and "3" in msg, msg


def test_mini_batch_not_divisible_by_the_pool_size():
    # 24 prompts split over 3 ranks, but a mini-batch of 8 does not.
    msg = pools_error(3, 1, "data.train_batch_size=24", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                      "actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1")
    assert "actor.ppo_mini_batch_size=8" in msg and "3" in msg
    msg = pools_error(1, 3, "data.train_batch_size=24", "actor.ppo_mini_batch_size=12", "critic.ppo_mini_batch_size=8",
                      "actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1")
    assert "critic.ppo_mini_batch_size=8" in msg


def test_micro_batch_must_divide_the_per_rank_mini_batch():
    # mini 32 over 2 ranks = 16 rows per rank; micro 3 (or 12) does not divide it.
    msg = pools_error(2, 2, "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=3")
    assert "actor.ppo_micro_batch_size_per_gpu=3" in msg and "16" in msg
    msg = pools_error(2, 2, "critic.ppo_mini_batch_size=32", "critic.ppo_micro_batch_size_per_gpu=12")
    assert "critic.ppo_micro_batch_size_per_gpu=12" in msg and "16" in msg
    # 128 / mini 64 over 2 ranks = 32 per rank; micro 24 does not divide it.
    msg = pools_error(1, 2, "critic.ppo_mini_batch_size=64", "critic.ppo_micro_batch_size_per_gpu=24")
    assert "critic.ppo_micro_batch_size_per_gpu=24" in msg and "32" in msg


def test_micro_batch_larger_than_a_ranks_mini_batch_is_one_micro_batch():
    # 32 / 4 = 8 rows per rank with the default micro-batch of 16: a single micro-batch.
    check_against_pools(load_config(), {"actor": 4, "critic": 4})
    check_against_pools(load_config(None, ["actor.ppo_micro_batch_size_per_gpu=12"]), {"actor": 4, "critic": 1})


@pytest.mark.parametrize(
    "actor, critic, overrides",
    [
        (1, 1, []),  # the defaults: 128 prompts, mini-batch 32, micro 16
        (2, 2, []),  # 16 rows of a mini-batch per rank
        (2, 1, []),
        (4, 4, ["actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=4"]),
        (3, 1, ["data.train_batch_size=24", "actor.ppo_mini_batch_size=12", "critic.ppo_mini_batch_size=12",
                "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=6"]),
    ],
)
def test_valid_layouts_pass(actor, critic, overrides):
    check_against_pools(load_config(None, overrides), {"actor": actor, "critic": critic})


# --------------------------------------------------------------------------- the command line


CLI_TIMEOUT = 30  # a config error must end the job in seconds; a process group would wait 600 s


class Rendezvous:
    """A listening socket posing as MASTER_ADDR:MASTER_PORT for a rank>0 environment: a process
    that tries to join a process group connects to it, which `connected()` sees."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def env(self, rank: int = 1):
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port)}

    def connected(self) -> bool:
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)

    def close(self):
        self.sock.close()


BAD_MAP = ["placement.mode=custom", "placement.pools={gen: 1, train: 1}",
           "placement.roles={rollout: gen, actor: train, critic: gen}"]
CLI_RUNS = {
    # a plain `python -m`, one rank; overrides on both sides of --config, as a launcher script adds its own
    "print_config": (["trainer.total_steps=7", "--print-config", "--config", "configs/colocate.yaml",
                      "trainer.seed=5"], False),
    "typo": (["trainer.totl_steps=3"], True),  # as rank 1 of a 2-rank torchrun
    "missing_model": (["model.path=/nonexistent/dir"], True),
    "missing_logger": (["trainer.logger=[console,mlflow]"], True),
}
# Started as a second batch (so that the batch above still starts in CLI_TIMEOUT on 2 busy cores):
# a role map plan_placement refuses, as each rank of a 2-rank torchrun (an int: as that rank).
CLI_PLACEMENT_RUNS = {
    **{f"bad_map_rank{rank}": (BAD_MAP, rank) for rank in (1, 0)},
    "staleness_with_the_actor": (["rollout.staleness=1"], True),
}
# Runs that must see a package as not installed (tests/support/launch.py's `cli` hides it).
CLI_HIDDEN = {"missing_logger": "mlflow"}


@pytest.fixture(scope="module")
def cli():
    """Runs every `python -m spmdsplit.train` case of CLI_RUNS at once (they are import-bound)
    and returns name -> (returncode, stdout, stderr, seconds, tried_to_join_a_process_group)."""
    return _run_cli(CLI_RUNS)


@pytest.fixture(scope="module")
def cli_placement():
    return _run_cli(CLI_PLACEMENT_RUNS)


def _run_cli(runs):
    from tests.support import launch

    started = {}
    for name, (args, as_rank1) in runs.items():
        rdv = Rendezvous() if as_rank1 is not False else None
        rank = 1 if as_rank1 is True else as_rank1  # True: rank 1; an int: that rank
        hide = (CLI_HIDDEN[name],) if name in CLI_HIDDEN else ()
        started[name] = (launch.cli(args, env=rdv.env(rank) if rdv else {}, hide=hide, cwd=REPO), rdv, time.monotonic())
    results = {}
    try:
        for name, (run, rdv, start) in started.items():
            try:
                result = run.wait(timeout=max(1.0, start + CLI_TIMEOUT - time.monotonic()))
                code, out, err = result.returncode, result.stdout, result.stderr
            except subprocess.TimeoutExpired as e:
                code, out, err = None, e.output, e.stderr + f"\n[test] still running after {CLI_TIMEOUT}s: killed"
            results[name] = (code, out, err, time.monotonic() - start, bool(rdv and rdv.connected()))
    finally:
        for run, rdv, _ in started.values():
            run.stop(grace=0)
            if rdv:
                rdv.close()
    return results


def test_print_config_without_torchrun(cli):
    # The default split placement could not run on one rank; printing the config must not care.
    rc, out, err, _, _ = cli["print_config"]
    assert rc == 0, err
    assert "  total_steps: 7\n" in out
    printed = OmegaConf.create(out)
    assert printed.trainer.total_steps == 7 and printed.data.max_response_length == 6
    assert printed.placement.mode == "colocate" and printed.trainer.seed == 5


def test_typo_exits_2_naming_the_key_before_any_process_group(cli):
    rc, out, err, took, joined = cli["typo"]
    assert rc == 2, (out, err)
    assert "trainer.totl_steps" in err
    assert "Traceback" not in err
    assert not joined, "the job tried to join a process group before checking its config"
    assert took < CLI_TIMEOUT


@pytest.mark.parametrize("rank", [0, 1])
def test_a_refused_role_map_exits_2_in_one_line_on_every_rank_before_any_process_group(cli_placement, rank):
    rc, out, err, took, joined = cli_placement[f"bad_map_rank{rank}"]
    assert rc == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"spmdsplit [rank {rank}]: error: placement.roles.rollout=gen: the rollout group sits either "
                     "with the actor (placement.roles.rollout=train) or on a pool of its own, not on the critic pool; "
                     "the maps that work: rollout+actor+critic+reward (= placement.mode=colocate); "
                     "rollout+actor | critic+reward (= placement.mode=split); rollout | actor+critic+reward "
                     "(GRPO: rollout | actor); rollout | actor | critic+reward; any of these with reward on a pool of "
                     "its own"], err
    assert not joined, "the job tried to join a process group before checking its placement"
    assert took < CLI_TIMEOUT


def test_staleness_without_a_rollout_pool_of_its_own_exits_2_naming_it(cli_placement):
    rc, out, err, took, joined = cli_placement["staleness_with_the_actor"]
    assert rc == 2, (out, err)
    assert "error: rollout.staleness=1 needs a rollout pool of its own" in err
    assert "Traceback" not in err
    assert not joined


def test_missing_model_path_exits_2_naming_it(cli):
    rc, out, err, took, joined = cli["missing_model"]
    assert rc == 2, (out, err)
    assert "model.path" in err and "/nonexistent/dir" in err
    assert "Traceback" not in err
    assert not joined
    assert took < CLI_TIMEOUT


def test_a_chosen_logger_not_installed_exits_2_before_any_process_group(cli):
    rc, out, err, took, joined = cli["missing_logger"]
    assert rc == 2, (out, err)
    assert 'trainer.logger: mlflow is not installed (pip install -e ".[mlflow]")' in err
    assert "Traceback" not in err
    assert not joined
    assert took < CLI_TIMEOUT


# --------------------------------------------------------------------------- model paths (preflight.check_model_path)


def test_model_path_checks(tmp_path):
    from spmdsplit.preflight import check_model_path

    good = tmp_path / "model"
    good.mkdir()
    (good / "config.json").write_text("{}")
    check_model_path("model.path", str(good), False)
    check_model_path("model.path", "", False)  # "" = the embedded model
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"critic\.model_path=.*config\.json"):
        check_model_path("critic.model_path", str(empty), False)
    for missing in (str(tmp_path / "absent"), "./absent/model", "/nonexistent/dir"):
        with pytest.raises(ConfigError, match=r"model\.path=.*no such folder"):
            check_model_path("model.path", missing, False)


def test_model_path_under_home_with_a_tilde(tmp_path, monkeypatch):
    # The shell leaves `model.path=~/m` alone (model.path is not a variable name), so "~" arrives as is.
    from spmdsplit.preflight import check_model_path

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "mymodel" / "config.json").write_text("{}")
    check_model_path("model.path", "~/mymodel", False)


def test_stream_chunks_must_split_evenly_over_both_pools():
    cfg = load_config(None, ["rollout.stream_chunks=4", "data.train_batch_size=16",
                             "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8"])
    check_against_pools(cfg, {"actor": 2, "critic": 2})  # 4 chunks of 4 rows: 2 per rank in either pool
    with pytest.raises(ConfigError, match=r"rollout.stream_chunks=4: data.train_batch_size=16 must split"):
        check_against_pools(cfg, {"actor": 2, "critic": 3})  # a chunk of 4 rows cannot be shared by 3 critic ranks
    with pytest.raises(ConfigError, match=r"rollout.stream_chunks=4"):
        check_against_pools(cfg, {"actor": 8, "critic": 1})  # 16 rows / 8 actor ranks = 2 rows per rank: not 4 chunks


# --------------------------------------------------------------------------- the embedded preset


def test_embedded_preset_applies_only_without_a_model_path(tmp_path):
    from spmdsplit.config import EMBEDDED_PRESET

    toy = load_config()
    assert toy.actor.optim.lr == EMBEDDED_PRESET["actor"]["optim"]["lr"]
    assert toy.critic.optim.lr == EMBEDDED_PRESET["critic"]["optim"]["lr"]
    real = load_config(None, [f"model.path={tmp_path}"])
    assert (real.actor.optim.lr, real.critic.optim.lr) == (1e-6, 1e-5)  # verl's, from the schema
    assert real.actor.entropy_coeff == 0.0
    # Overrides and files beat the preset.
    assert load_config(None, ["actor.optim.lr=0.01"]).actor.optim.lr == 0.01
    path = tmp_path / "p.yaml"
    path.write_text("critic:\n  optim:\n    lr: 0.03\n")
    assert load_config(str(path)).critic.optim.lr == 0.03


def test_high_lr_on_a_real_model_warns(tmp_path):
    from spmdsplit.config import config_warnings

    assert config_warnings(load_config()) == []  # the toy's 2e-3 is right for it
    assert config_warnings(load_config(None, [f"model.path={tmp_path}"])) == []
    warned = config_warnings(load_config(None, [f"model.path={tmp_path}", "actor.optim.lr=1e-4"]))
    assert len(warned) == 1 and "actor.optim.lr" in warned[0]


@pytest.mark.parametrize("override", ["rollout.top_p=0.9", "rollout.top_k=20"])
def test_truncated_sampling_warns_that_ppo_is_off_policy(override):
    from spmdsplit.config import config_warnings

    assert any("off-policy" in w for w in config_warnings(load_config(None, [override])))


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("placement.pools={actor:[1],critic:[2]}", "placement.pools", "a YAML list"),
        ("actor.optim={lr:[1}", "actor.optim", "a YAML mapping"),
        ("trainer.total_steps=[1", "trainer.total_steps", "int"),
        ("data.task=\"repeat", "data.task", "a string"),
    ],
)
def test_override_that_yaml_cannot_parse_names_key_value_and_form(override, key, expected):
    msg = error_of(override)
    assert msg.startswith(f"{key}=") and override.split("=", 1)[1] in msg and expected in msg
    assert "\n" not in msg


def test_config_file_that_yaml_cannot_parse_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("trainer:\n  total_steps: 3\nplacement:\n  pools: {actor:[1],critic:[2]}\n")
    msg = error_of(config_file=str(path))
    assert str(path) in msg and "line 4" in msg and "\n" not in msg
    path.write_text("- 1\n- 2\n")
    assert "mapping" in error_of(config_file=str(path))


# --------------------------------------------------------------------------- shapes and declared checks


@pytest.mark.parametrize(
    "override, message",
    [
        ("placement.roles=[a]", "placement.roles: expected a mapping, got a list"),
        ("placement.roles={rollout: [a]}", "placement.roles.rollout: expected a string, got a list"),
        ("actor.optim.lr={x: 1}", "actor.optim.lr: expected a number, got a mapping"),
        ("actor.optim.lr=[1,2]", "actor.optim.lr: expected a number, got a list"),
        ("actor.optim.betas={a: 1}", "actor.optim.betas: expected a list, got a mapping"),
        ("actor.optim.betas=3", "actor.optim.betas: expected a list, got 3"),
        ("placement.pools=[{a: 1}]", "placement.pools=[{'a': 1}]: expected a list of sizes [actor, critic], e.g. "
         "placement.pools=[6,2], or a mapping pool name -> size, e.g. placement.pools='{gen: 1, train: 1}'"),  # typed Any
        ("placement.pools={a: x}", "placement.pools.a='x': expected a whole number (a pool's size)"),
        ("placement.mode={a: 1}", "placement.mode: expected a string, got a mapping"),
        ("actor.clip_ratio_low={a: 1}", "actor.clip_ratio_low: expected a number, got a mapping"),  # Optional[float]
        ("actor=[1,2]", "actor: expected a section (a mapping of its keys), got a list"),  # was key '?'
        ("actor.optim=3", "actor.optim: expected a section (a mapping of its keys), got 3"),  # was key '?'
        ("reward.model=x", "reward.model: expected a section (a mapping of its keys), got 'x'"),
        ("data.train_files={a: 1}", "data.train_files={'a': 1}: expected a path or a list of paths"),  # typed Any
    ],
)
def test_a_value_of_the_wrong_shape_is_one_line_naming_the_full_key(override, message):
    msg = error_of(override)
    assert msg == message and "\n" not in msg


def test_overrides_of_different_shapes_for_one_key_are_each_checked():
    # Merged together first, these two would end in a TypeError from the merge.
    assert error_of("actor.optim.betas=[3,1]", "actor.optim.betas={a: 1}") == "actor.optim.betas: expected a list, got a mapping"


def test_placement_pools_is_a_list_or_a_mapping_and_a_later_one_replaces_it():
    # OmegaConf cannot merge a mapping into a list: load_config folds placement.pools itself.
    assert list(load_config(None, ["placement.pools={gen: 1, train: 1}", "placement.pools=[3,1]"]).placement.pools) == [3, 1]
    cfg = load_config(None, ["placement.pools=[3,1]", "placement.pools={gen: 1, train: 1}", "placement.pools.gen=2"])
    assert dict(cfg.placement.pools) == {"gen": 2, "train": 1}  # a later mapping adds to an earlier one


def test_a_config_file_with_the_wrong_shape_names_the_full_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor:\n  optim:\n    lr:\n      x: 1\n")
    assert error_of(config_file=str(path)) == "actor.optim.lr: expected a number, got a mapping"
    path.write_text("critic: [1, 2]\n")
    assert error_of(config_file=str(path)) == "critic: expected a section (a mapping of its keys), got a list"
    path.write_text("data:\n  train_files: [a.parquet, b.parquet]\n")
    assert list(load_config(str(path)).data.train_files) == ["a.parquet", "b.parquet"]


def test_choices_and_ranges_come_from_the_fields():
    from spmdsplit.config import Config, declared_checks
    from spmdsplit.preflight import REGISTERED

    checks = dict(declared_checks())
    # Nested sections share their field's declaration: one OptimConfig field, two keys.
    assert {"actor.optim.lr_scheduler_type", "critic.optim.min_lr_ratio", "rollout.val_kwargs.n",
            "ref.zero_stage", "reward.model.zero_stage"} <= set(checks)
    # Names the runtime registers are checked at start-up, not declared on the (import-free) schema.
    assert "data.task" in REGISTERED and not set(REGISTERED) & set(checks)
    defaults = OmegaConf.structured(Config)
    for key, check in checks.items():  # every default passes its own check
        assert check(key, OmegaConf.select(defaults, key)) is None, key


def test_flash_attention_without_flash_attn_is_one_line_naming_the_key(monkeypatch):
    import importlib.util

    from spmdsplit.models import flash_attn_unavailable
    from spmdsplit.preflight import check_flash_attn_installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    # The config loads (a GPU preset prints anywhere); start-up (preflight.check_device) refuses it.
    cfg = load_config(None, ["model.attn_implementation=flash_attention_2"])
    flash_attn_unavailable.cache_clear()
    try:
        with pytest.raises(ConfigError) as e:
            check_flash_attn_installed(cfg)
    finally:
        flash_attn_unavailable.cache_clear()
    msg = str(e.value)
    assert msg.startswith("model.attn_implementation=flash_attention_2") and "\n" not in msg
    assert "model.attn_implementation" in error_of("model.attn_implementation=flash")
    check_config(load_config(None, ["model.attn_implementation=eager", "model.use_remove_padding=true"]))


def test_a_token_budget_below_the_longest_row_is_allowed():
    check_config(load_config(None, ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=3",
                                    "data.max_prompt_length=8"]))


def test_the_reference_follows_the_actors_token_budget_unless_set():
    from spmdsplit.roles.build import ref_config

    cfg = load_config(None, ["actor.use_dynamic_bsz=true", "actor.log_prob_max_token_len_per_gpu=100"])
    ref = ref_config(cfg)
    assert ref.use_dynamic_bsz and ref.log_prob_max_token_len_per_gpu == 100
    cfg = load_config(None, ["actor.use_dynamic_bsz=true", "ref.log_prob_use_dynamic_bsz=false",
                             "ref.log_prob_max_token_len_per_gpu=50", "ref.log_prob_micro_batch_size_per_gpu=4"])
    ref = ref_config(cfg)
    assert not ref.use_dynamic_bsz and ref.log_prob_max_token_len_per_gpu == 50
    assert ref.log_prob_micro_batch_size_per_gpu == 4 and cfg.actor.use_dynamic_bsz


# --------------------------------------------------------------------------- role groups (issue 19)

GEN_TRAIN = ["placement.mode=custom", "placement.pools={gen: 1, train: 1}"]


def _placed(overrides, shape=(2, 2, 1)):
    from spmdsplit.placement import plan_from_config
    from spmdsplit.preflight import check_against_placement

    cfg = load_config(None, overrides)
    check_config(cfg)
    placement = plan_from_config(cfg, *shape)
    check_against_placement(cfg, placement)
    return cfg, placement


def test_named_pools_and_roles_load_and_plan():
    _, p = _placed(GEN_TRAIN + ["placement.roles={rollout: gen, actor: train, critic: train}"])
    assert p.ranks("rollout") == (1,) and p.ranks("actor") == p.ranks("critic") == (0,)


def test_logits_chunk_size_is_declared_non_negative():
    assert load_config().actor.logits_chunk_size == 512 and load_config(None, ["actor.logits_chunk_size=0"])
    assert error_of("actor.logits_chunk_size=-1") == "actor.logits_chunk_size=-1: expected >= 0 tokens (0 = not chunked)"


def test_staleness_is_declared_non_negative():
    assert load_config().rollout.staleness == 0
    assert error_of("rollout.staleness=-1") == "rollout.staleness=-1: expected >= 0 (0 = on-policy)"


@pytest.mark.parametrize("overrides, shape, message", [
    (["rollout.staleness=1"], (4, 4, 1), "rollout.staleness=1 needs a rollout pool of its own"),
    (["rollout.staleness=2", "placement.mode=colocate"], (2, 2, 1), "rollout.staleness=2 needs a rollout pool of its own"),
    (GEN_TRAIN + ["placement.roles={rollout: gen, actor: train}", "rollout.ranks=all"], (2, 2, 1),
     "rollout.ranks=all with a rollout pool of its own"),
    (GEN_TRAIN + ["placement.roles={rollout: gen, actor: train}", "rollout.stream_chunks=2"], (2, 2, 1),
     "rollout.stream_chunks=2 with a rollout pool of its own"),
    (["placement.mode=custom", "placement.pools={gen: 3, train: 1}", "placement.roles={rollout: gen, actor: train}",
      "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "critic.ppo_mini_batch_size=16"], (4, 4, 1),
     "data.train_batch_size=16 is not divisible by the rollout pool size 3"),
    # rollout.ranks=all, read off the placement (the rollout group spans the critic's pool), not
    # guessed from placement.mode: a custom pair of pools is two pools too.
    (["placement.mode=custom", "placement.pools=[2,1]", "rollout.ranks=all", "data.train_batch_size=16",
      "actor.ppo_mini_batch_size=16", "critic.ppo_mini_batch_size=16"], (3, 3, 1),
     "rollout.ranks=all: data.train_batch_size=16 must divide over all 3 ranks"),
    (["rollout.ranks=all", "rollout.stream_chunks=2", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
      "critic.ppo_mini_batch_size=16"], (4, 4, 1), "rollout.ranks=all with rollout.stream_chunks=2"),
])
def test_checks_that_need_the_placement_name_the_key(overrides, shape, message):
    with pytest.raises(ConfigError) as e:
        _placed(overrides, shape)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_staleness_without_a_correction_warns():
    from spmdsplit.config import config_warnings

    stale = GEN_TRAIN + ["placement.roles={rollout: gen, actor: train}", "rollout.staleness=1"]
    assert any(w.startswith("rollout.staleness=1 with algorithm.rollout_correction.rollout_is=null")
               for w in config_warnings(load_config(None, stale)))
    for fix in ("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.bypass_mode=true"):
        assert config_warnings(load_config(None, stale + [fix])) == []


GRPO = ["algorithm.adv_estimator=grpo", "rollout.n=2"]


@pytest.mark.parametrize("overrides", [
    ["placement.mode=colocate"],
    GEN_TRAIN + ["placement.roles={rollout: gen, actor: train}"],  # rollout | actor: the reward on the actor's pool
    GEN_TRAIN + ["placement.roles={rollout: gen, actor: train, critic: train}"],
])
def test_grpo_without_a_reward_model_where_the_critic_group_sits_with_the_actor(overrides):
    _placed(GRPO + overrides)


@pytest.mark.parametrize("overrides", [
    [],  # today's split
    ["placement.mode=custom", "placement.pools=[1,1]"],
    GEN_TRAIN + ["placement.roles={actor: gen, critic: train}"],
    ["placement.mode=custom", "placement.pools={gen: 1, policy: 1, value: 1}",
     "placement.roles={rollout: gen, actor: policy, critic: value}"],
])
def test_grpo_without_a_reward_model_refused_where_the_critic_group_has_a_pool_of_its_own(overrides):
    with pytest.raises(ConfigError) as e:
        _placed(GRPO + overrides, (3, 3, 1) if any("value: 1}" in o for o in overrides) else (2, 2, 1))
    assert str(e.value).startswith("algorithm.adv_estimator=grpo trains no critic")


def test_vllm_tensor_parallel_groups_lie_inside_one_of_three_pools():
    from spmdsplit.preflight import check_rollout_placement
    from spmdsplit.placement import plan_placement

    cfg = load_config()
    cfg.rollout.name, cfg.rollout.tensor_model_parallel_size = "vllm", 2  # set after loading: no vLLM needed
    roles = {"rollout": "gen", "actor": "policy", "critic": "value"}
    check_rollout_placement(cfg, plan_placement("custom", {"gen": 2, "policy": 2, "value": 2}, "ranks_per_node", 6, 6, 1,
                                                roles))
    with pytest.raises(ConfigError, match=r"straddles the actor pool \[0\] and the rollout pool \[1, 2\] and "
                                          r"the critic pool \[3\]; use a size that divides every pool"):
        check_rollout_placement(cfg, plan_placement("custom", {"gen": 2, "policy": 1, "value": 1}, "ranks_per_node",
                                                    4, 4, 1, roles))


# --------------------------------------------------------------------------- packed attention on a GPU


def packed_mask_error(device: str, *overrides):
    from spmdsplit.preflight import check_packed_attention

    cfg = load_config(None, ["model.use_remove_padding=true", "model.attn_implementation=sdpa", *overrides])
    try:
        check_packed_attention(cfg, device)
    except ConfigError as e:
        return str(e)
    return None


def test_sdpa_packing_past_a_1_gib_mask_is_refused_on_cuda_naming_the_budget():
    # 32768 tokens: 32768^2 x 2 B (bf16) = 2 GiB of mask per packed forward.
    msg = packed_mask_error("cuda", "critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=32768")
    assert msg.startswith("model.use_remove_padding=true with model.attn_implementation=sdpa on cuda")
    assert "critic.forward_max_token_len_per_gpu" in msg and "2.0 GiB" in msg and "\n" not in msg
    assert "model.attn_implementation=auto" in msg
    # fp32 doubles it: 20000 tokens is 0.75 GiB in bf16 (allowed), 1.5 GiB in fp32 (refused).
    budget = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=20000"]
    assert packed_mask_error("cuda", *budget, "model.dtype=bfloat16") is None
    assert "actor.ppo_max_token_len_per_gpu" in packed_mask_error("cuda", *budget, "model.dtype=float32")
    # Fixed micro-batches count rows x the longest row: 64 rows x 512 tokens = 32768.
    msg = packed_mask_error("cuda", "critic.forward_micro_batch_size_per_gpu=64",
                            "data.max_prompt_length=256", "data.max_response_length=256")
    assert "critic.forward_micro_batch_size_per_gpu" in msg


def test_the_mask_check_spares_cpu_flash_attention_and_unpacked_passes():
    big = ["critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=65536"]
    assert packed_mask_error("cpu", *big) is None  # CPU's budgets are the user's to keep small
    for mask_free in ("flash_attention_2", "varlen", "auto"):
        assert packed_mask_error("cuda", *big, f"model.attn_implementation={mask_free}") is None
    from spmdsplit.preflight import check_packed_attention

    check_packed_attention(load_config(None, big), "cuda")  # not packed: no mask at all
    # trainer.device=cuda says so when the config loads; auto waits for start-up (preflight.check_device).
    assert "critic.forward_max_token_len_per_gpu" in error_of("model.use_remove_padding=true", "trainer.device=cuda",
                                                              "model.attn_implementation=sdpa", *big)


def test_an_empty_mapping_on_the_command_line_replaces_a_presets_mapping():
    """`key={}` empties a mapping a preset sets (OmegaConf's merge would keep its entries: a TRL-style
    environment, built with no arguments, could not clear environment_kwargs={turns: 3}); a later
    override adds to it again, and `{}` on a section of the schema changes nothing."""
    preset = os.path.join(os.path.dirname(__file__), "..", "configs", "environment_echo.yaml")
    assert load_config(preset).rollout.multi_turn.environment_kwargs == {"turns": 3}
    cfg = load_config(preset, ["rollout.multi_turn.environment_kwargs={}"])
    assert cfg.rollout.multi_turn.environment_kwargs == {}
    cfg = load_config(preset, ["rollout.multi_turn.environment_kwargs={}", "rollout.multi_turn.environment_kwargs.n=2"])
    assert cfg.rollout.multi_turn.environment_kwargs == {"n": 2}
    cfg = load_config(preset, ["rollout.multi_turn={}"])
    assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.environment_kwargs == {"turns": 3}
