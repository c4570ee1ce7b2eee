"""The reward group's program, when it has a pool of its own (placement.roles.reward): it scores each
chunk of the rollout as it arrives, while the critic group computes its values, and sends the
scores to the critic group; it scores the validation responses. Its reward model runs on its own
pool's mesh with its own token budgets (reward.model.*). Messages: spmdsplit/messages.py."""

from __future__ import annotations

from spmdsplit import scoring
from spmdsplit.dumps import Dumps
from spmdsplit.exchange import PendingSend
from spmdsplit.messages import PoolChannel
from spmdsplit.timing import PhaseTimer
from spmdsplit.groups import Pools
from spmdsplit.programs import Program
from spmdsplit.roles.reward import RuleReward
from spmdsplit.roles.reward_model import RewardModel


class RewardProgram(Program):  # nothing trained: a checkpoint keeps only the ranks' state

    def __init__(self, cfg, pools: Pools, reward: RuleReward | RewardModel, channel: PoolChannel, timer: PhaseTimer,
                 dumps: Dumps):
        """`dumps`: trainer.validation_data_dir's, written where the validation responses are scored."""
        self.cfg, self.pools, self.reward, self.channel, self.timer = cfg, pools, reward, channel, timer
        self.dumps = dumps
        self.chunks = cfg.rollout.stream_chunks

    def score(self, step: int) -> dict[str, float]:
        """rollout in (each chunk scored as it arrives) -> scores out. Returns the reward's metrics
        (e.g. "acc"). The scores go out only once every chunk is in: where the critic shares the
        actor's ranks, the actor still sends chunks to this rank while the critic would take
        scores from it, and NCCL runs both directions between two ranks on one stream in posting
        order (spmdsplit/messages.py). The critic needs them all for the advantages anyway."""
        scored = []
        for c in range(self.chunks):
            with self.timer.phase("exchange/rollout/reward", step, chunk=c) as stats:  # the critic's is exchange/rollout
                part = self.channel.recv_step_rows(step, c, stats, to="reward")
            with self.timer.phase("reward", step, chunk=c):
                scored.append(part.update(scoring.score_rollout(self.reward, part, self.timer, step, c)))
        sends = PendingSend()
        for c, part in enumerate(scored):
            sends.add(self.channel.send_scores(step, c, part))
        metrics = self.reward.pop_extra_metrics(self.pools.group("reward"), self.pools.device)
        sends.wait()
        return metrics

    def close(self) -> None:
        if self.reward is not None:
            self.reward.close()

    def score_validation(self, step: int, val_set) -> dict[str, float]:
        return scoring.score_validation(self.pools, self.reward, self.channel, self.timer, step, val_set,
                                        self.dumps.validation)
