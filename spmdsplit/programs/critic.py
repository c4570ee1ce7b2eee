"""The critic group's program: values of the rollout as it arrives, its scores (the reward group's,
computed here when it shares the pool, else received from its pool), advantages sent back, then the
critic's update (which may run on while the actor pool generates the next step).
Messages: spmdsplit/messages.py."""

from __future__ import annotations

from spmdsplit import algo, scoring
from spmdsplit.batch import Batch
from spmdsplit.distributed import pool_sum
from spmdsplit.dumps import Dumps
from spmdsplit.messages import PoolChannel, check_rows, receive_for
from spmdsplit.batch_metrics import compute_data_metrics
from spmdsplit.timing import PhaseTimer
from spmdsplit.groups import Pools
from spmdsplit.programs import Program
from spmdsplit.roles.build import CriticRoles
from spmdsplit.roles.reward import RuleReward
from spmdsplit.roles.reward_model import RewardModel
from spmdsplit.seeds import update_seed


class CriticProgram(Program):
    def __init__(self, cfg, pools: Pools, roles: CriticRoles, channel: PoolChannel, timer: PhaseTimer, handoff,
                 reward: RuleReward | RewardModel | None, dumps: Dumps):
        """`reward`: the reward group's reward when it shares this pool (None: its own pool scores);
        `dumps`: trainer.rollout_data_dir's (the rows as trained) and, scoring here, validation_data_dir's."""
        self.cfg, self.pools, self.channel, self.timer, self.handoff = cfg, pools, channel, timer, handoff
        self.critic, self.kl_ctrl, self.reward, self.dumps = roles.critic, roles.kl_ctrl, reward, dumps
        self.chunks = cfg.rollout.stream_chunks
        self.batch: Batch | None = None  # this step's rows, from compute_advantages to update
        self.metrics: dict[str, float] = {}  # the advantages' metrics, reported with the update's
        self.sends: list = []  # the advantages' sends, waited for at the end of the update

    @property
    def engine(self):
        """What a checkpoint saves of this group (None for critic-free estimators)."""
        return self.critic.engine if self.critic is not None else None

    def compute_advantages(self, step: int) -> None:
        """rollout in (values + scores per chunk) [-> log-probs in] -> adv -> advantages out to
        the actor group."""
        phase, channel = self.timer.phase, self.channel
        parts = []
        for c in range(self.chunks):
            with phase("exchange/rollout", step, chunk=c) as stats:
                part = channel.recv_step_rows(step, c, stats)
            if c == 0:
                self.handoff()  # blocking mode: values start once the actor pool's log-probs are done
            if self.critic is not None:
                with phase("values", step, chunk=c):
                    part["values"] = self.critic.compute_values(part)
            if self.reward is not None:
                with phase("reward", step, chunk=c):
                    part.update(scoring.score_rollout(self.reward, part, self.timer, step, c))
            parts.append(part)
        if self.reward is None:  # scored on the reward group's own pool meanwhile, sent once all chunks were in
            for c, part in enumerate(parts):
                with phase("exchange/scores", step, chunk=c) as stats:
                    scores = channel.recv_scores(step, c, stats)
                check_rows(scores, part, "scores")
                del scores.tensors["row_index"]
                part.update(scores.with_width(part["responses"].shape[1]))
        # Each chunk is as wide as the longest response in it (inference/base.py): pad them to one width.
        batch = Batch.concat(parts, pad_to_widest=True)
        if self.cfg.algorithm.use_kl_in_reward:  # sent after every rollout chunk, so taken after them
            log_probs = receive_for(batch, channel.recv_log_probs, "log-probs", step, self.chunks, self.timer,
                                    "exchange/log_probs")
            batch.update(log_probs.select(["old_log_probs", "ref_log_prob"]))
        with phase("adv", step):
            reduce_sum = pool_sum(self.pools.group("critic"))  # statistics of the whole global batch
            metrics = algo.compute_advantage(batch, self.cfg.algorithm, self.kl_ctrl, reduce_sum)
        if self.reward is not None:
            metrics.update(self.reward.pop_extra_metrics(self.pools.group("reward"), self.pools.device))  # e.g. "acc"
        # Back in the chunks they came in, so each actor rank gets exactly its rows.
        self.sends = [channel.send_advantages(step, c, part) for c, part in enumerate(batch.split(len(parts[0])))]
        self.batch, self.metrics = batch, metrics

    def update(self, step: int) -> dict[str, float]:
        """update_critic; the rows' data metrics and dump. Returns the group's metrics of the step."""
        batch, metrics, phase = self.batch, self.metrics, self.timer.phase
        if self.critic is not None:
            with scoring.judge_asleep(self.reward, self.timer, step), phase("update_critic", step):
                metrics.update(self.critic.update_critic(batch, seed=update_seed(self.cfg.trainer.seed, step)))
        metrics.update(compute_data_metrics(batch, self.pools.group("critic"), self.pools.device,
                                            self.cfg.data.max_response_length))
        if self.dumps.rollout:
            with phase("dump", step):
                trained = batch if "episode_row" not in batch else batch.index(  # an empty row trains nothing
                    (batch["episode_row"] >= 0).nonzero().squeeze(1).tolist())
                self.dumps.rollout.write(step, trained, trained["token_level_scores"].sum(-1))
        self.handoff()  # blocking mode: the actor updates only after the critic did
        for sent in self.sends:
            sent.wait()
        self.batch, self.metrics, self.sends = None, {}, []
        return metrics

    def close(self) -> None:
        if self.reward is not None:
            self.reward.close()

    def score_validation(self, step: int, val_set) -> dict[str, float] | None:
        if self.reward is None:  # a reward pool of its own scores them
            return None
        return scoring.score_validation(self.pools, self.reward, self.channel, self.timer, step, val_set,
                                        self.dumps.validation)

    def state(self, step: int) -> dict:
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_state(self, state: dict, same_layout: bool) -> None:
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
