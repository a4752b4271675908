"""The GRPO loop: the shared loop (loops/base.py) where a step samples its own batch.

One step of this loop, on every data-parallel rank:

1. sample: the rank's `training.batch_size` prompts (data/prompts.py), each `grpo.num_generations`
   times, from the current policy: the model being trained, its own weights, through
   `titan_tpu.generate` (static KV cache, temperature / top-k / top-p), from a generator seeded by
   (training.seed, step, data-parallel rank); the sampler reports each token's log-probability at
   the sampling temperature, which is the old policy's log-probability of the ratio;
2. score: the rewards (train/rewards.py) of every completion, the advantages within each prompt's
   group (train/grpo.py `group_advantages`) and, with a KL penalty, the reference's
   log-probabilities (one forward without gradients);
3. train: `grpo.passes` optimizer updates over these samples, each the run's step function (the
   step contract, train/step.py) over `training.grad_accum_steps` micro-batches of them with the
   GRPO objective.

So `training.steps` counts batches of samples, each making `grpo.passes` updates. A checkpoint
falls between steps, where no samples are pending: the prompt loader's position and the step
(from which every sampler seed follows) are all a resumed run needs to sample what the
uninterrupted run would have sampled.

A metrics row adds TRL's names: `reward`, `reward_std` (the mean over groups of the group's
standard deviation), `rewards/<name>/mean` per reward, `frac_reward_zero_std`,
`completions/mean_length`, `/min_length`, `/max_length`, `/clipped_ratio` (the share that hit
max_completion_length without a stop token), the objective's `kl` and `clip_ratio/*`, and the
time split `sampling_s` / `training_s` (per step, means over the rows' window).
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch

from titan_tpu.data.batch import IGNORE_INDEX, RolloutBatch
from titan_tpu.data.prompts import PromptRow
from titan_tpu.generate import Sampling, generate
from titan_tpu.loops.base import Loop
from titan_tpu.train.grpo import group_advantages, token_logps
from titan_tpu.train.step import StepResult, all_reduce_sum

__all__ = ["GRPOLoop", "rollout_batch"]


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], old_logps: list[list[float]], *,
                  advantages_N: torch.Tensor, pad_id: int) -> RolloutBatch:
    """Rows of prompt + completion, right-padded to the longest, as inputs and labels (the next
    token where it is a completion token, else IGNORE_INDEX), with the sampler's log-probabilities
    at the labels' positions."""
    N = len(prompts)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    tokens_NT = torch.full((N, width), pad_id, dtype=torch.long)
    labels_NS = torch.full((N, width - 1), IGNORE_INDEX, dtype=torch.long)
    old_NS = torch.zeros(N, width - 1)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        P, C = len(p), len(c)
        tokens_NT[i, :P + C] = torch.tensor(p + c, dtype=torch.long)
        labels_NS[i, P - 1:P - 1 + C] = torch.tensor(c, dtype=torch.long)
        old_NS[i, P - 1:P - 1 + C] = torch.tensor(old_logps[i][:C])
    return RolloutBatch(tokens_NT[:, :-1].contiguous(), labels_NS, advantages_N.float(), old_NS)


class GRPOLoop(Loop):
    # kl, reward (with its std) and the sampling/training split have console formats of their own;
    # TRL's clip ratios, completion lengths and per-reward means stay in metrics.jsonl
    console_keys = ()

    def __init__(self, components):
        super().__init__(components)
        g = self.cfg.grpo
        self.sampling_parts = components.extras  # the rewards and stop ids (kinds/grpo.py SamplingParts)
        self.sampling = Sampling(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        self._window: dict[str, list[float]] = defaultdict(list)  # rollout metrics since the last metrics row

    def sampler_seed(self, step: int) -> int:
        """The seed of step `step`'s sampling on this rank: a function of the run's seed, the step and
        the data-parallel rank, so a resumed run draws what the uninterrupted one drew."""
        dp_rank = self.components.batch_split.dp_rank
        return int(np.random.SeedSequence([self.cfg.training.seed, step, dp_rank]).generate_state(1)[0])

    # ------------------------------------------------------------------------------------------
    # one step: sample, score, train

    def train_step(self) -> StepResult:
        self.step += 1
        start = time.perf_counter()
        micro_batches = self.rollout()
        sampled = time.perf_counter()
        lr = self.lr(self.step)
        results = [self.components.step_fn(micro_batches, lr) for _ in range(self.cfg.grpo.passes)]
        self._window["sampling_s"].append(sampled - start)
        self._window["training_s"].append(time.perf_counter() - sampled)
        terms = {k: sum(r.terms[k] for r in results) / len(results) for k in results[0].terms}
        return StepResult(loss=sum(r.loss for r in results) / len(results), grad_norm=results[-1].grad_norm,
                          num_tokens=sum(r.num_tokens for r in results), terms=terms)

    def rollout(self) -> list[RolloutBatch]:
        """This rank's samples of the step, scored, as training.grad_accum_steps micro-batches."""
        parts, g = self.components, self.cfg.grpo
        tokenizer, device = parts.tokenizer, parts.backend.device
        rows: list[PromptRow] = parts.train_loader.next_batch()
        G = g.num_generations
        repeated = [row for row in rows for _ in range(G)]
        out = generate(parts.model, [row.ids for row in repeated], max_new_tokens=g.max_completion_length,
                       sampling=self.sampling, stop_ids=self.sampling_parts.stop_ids,
                       seed=self.sampler_seed(self.step), pad_id=tokenizer.eos_id, logprob_temperature=g.temperature,
                       until_all_stop=parts.world_size == 1)
        completion_ids = [out.completion(i) for i in range(len(repeated))]
        stopped = out.stopped_B.tolist()
        texts = [tokenizer.decode(ids[:-1] if stop else ids, skip_special_tokens=True)
                 for ids, stop in zip(completion_ids, stopped)]
        prompts = [row.prompt for row in repeated]
        completions = [[{"role": "assistant", "content": t}] if row.chat else t for row, t in zip(repeated, texts)]
        names = sorted({key for row in rows for key in row.columns})
        columns = {key: [row.columns.get(key) for row in repeated] for key in names}
        columns["completion_ids"] = [ids[:-1] if stop else ids for ids, stop in zip(completion_ids, stopped)]
        rewards, per_reward = self.sampling_parts.rewards.score(prompts, completions, columns)
        rewards_N = torch.tensor(rewards, dtype=torch.float32)
        advantages_N = group_advantages(rewards_N, group_size=G, scale=g.scale_rewards,
                                        batch_std=self._global_std(rewards_N) if g.scale_rewards == "batch" else None)
        logps = out.logprobs_BN.tolist()
        batch = rollout_batch([row.ids for row in repeated], completion_ids, logps, advantages_N=advantages_N,
                              pad_id=tokenizer.eos_id).to(device)
        if g.beta:
            batch = RolloutBatch(batch.inputs_BS, batch.labels_BS, batch.advantages_B, batch.old_logps_BS,
                                 self._reference_logps(batch))
        self._record(rewards_N, per_reward, out.lengths_B.float(), out.stopped_B)
        k = self.components.run.grad_accum_steps  # GRPO refuses global_batch_tokens: the config's (kinds/grpo.py)
        size = len(repeated) // k
        return [_rows(batch, slice(i * size, (i + 1) * size)) for i in range(k)]

    @torch.no_grad()
    def _reference_logps(self, batch: RolloutBatch) -> torch.Tensor:
        t, parts = self.cfg.grpo.temperature, self.components
        if parts.reference is None:  # LoRA: the policy's base model, its adapters skipped
            from titan_tpu.models.lora import adapters_disabled

            with adapters_disabled():
                return token_logps(parts.model(batch.inputs_BS), batch.labels_BS, temperature=t)
        return token_logps(parts.reference(batch.inputs_BS), batch.labels_BS, temperature=t)

    def _global_std(self, rewards_N: torch.Tensor) -> torch.Tensor:
        """The standard deviation (Bessel-corrected) of the step's rewards on all data-parallel ranks."""
        sums = all_reduce_sum(torch.stack([rewards_N.sum(), (rewards_N ** 2).sum(),
                                           torch.tensor(float(rewards_N.numel()))]).double())
        n = sums[2]
        return ((sums[1] - sums[0] ** 2 / n) / (n - 1)).clamp(min=0).sqrt().float()

    def _record(self, rewards_N, per_reward: dict[str, float], lengths_N, stopped_N) -> None:
        """The step's rollout metrics on all ranks (sums over ranks, then means), into the window."""
        G = self.cfg.grpo.num_generations
        group_std = rewards_N.view(-1, G).std(dim=1)
        local = torch.stack([rewards_N.sum(), group_std.sum(), (group_std < 1e-8).float().sum(),
                             lengths_N.sum(), (~stopped_N.cpu()).float().sum(), torch.tensor(float(len(rewards_N))),
                             torch.tensor(float(len(group_std))), *[torch.tensor(v * len(rewards_N))
                                                                   for v in per_reward.values()]]).double()
        extremes = torch.stack([-lengths_N.min(), lengths_N.max()]).double()
        if self.components.world_size > 1:
            import torch.distributed as dist

            all_reduce_sum(local)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        n, groups = local[5].item(), local[6].item()
        w = self._window
        w["reward"].append(local[0].item() / n)
        w["reward_std"].append(local[1].item() / groups)
        w["frac_reward_zero_std"].append(local[2].item() / groups)
        w["completions/mean_length"].append(local[3].item() / n)
        w["completions/clipped_ratio"].append(local[4].item() / n)
        w["completions/min_length"].append(-extremes[0].item())
        w["completions/max_length"].append(extremes[1].item())
        for i, name in enumerate(per_reward):
            w[f"rewards/{name}/mean"].append(local[7 + i].item() / n)

    def objective_metrics(self, result: StepResult) -> dict[str, float]:
        row = dict(result.terms)
        row.update({k: sum(v) / len(v) for k, v in self._window.items() if v})
        self._window.clear()
        return row


def _rows(batch: RolloutBatch, rows: slice) -> RolloutBatch:
    fields = (batch.inputs_BS, batch.labels_BS, batch.advantages_B, batch.old_logps_BS, batch.ref_logps_BS)
    return RolloutBatch(*(None if t is None else t[rows].contiguous() for t in fields))
