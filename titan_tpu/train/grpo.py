"""Group relative policy optimisation (Shao et al., 2024, DeepSeekMath) as an objective (train/objective.py).

A micro-batch is a `RolloutBatch`: prompt + completion rows the policy sampled, labels on the
completion tokens, each row's advantage, and the log-probabilities of each completion token under
the policy that sampled it (old) and under the frozen reference. With the policy's log-probability
logp of a token (logits over the sampling temperature, as TRL scores), its ratio to the sampler's
r = exp(logp - old), the row's advantage A, and eps_low = epsilon, eps_high = epsilon_high or epsilon,

    per-token loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) + beta * KL
    KL = r * (exp(ref - logp) - (ref - logp) - 1)    (Schulman's k3 estimator, >= 0, times the ratio)

This is TRL's GRPOTrainer formulation (trl 1.16, grpo_trainer.py `_compute_loss`, loss types
"dapo", "grpo", "dr_grpo", token-level importance sampling), the one DeepSeekMath writes, and it
is chosen because it is the one users compare with: the same ratio, clipping and k3 KL per token,
the KL added to the loss (not folded into the reward as in PPO-RLHF). The factor r on the KL term
is TRL's `use_bias_correction_kl` (its default since 1.x, from DeepSeek-V3.2): the tokens were
drawn from the old policy, so weighting k3 by the ratio makes its gradient the unbiased gradient
of the reverse KL; r is differentiated (it changes the gradient even where it equals 1).
`kl_correction=False` gives DeepSeekMath's plain k3. The token losses add up as `loss_type` says:

* "dapo" (TRL's default since 0.20): the sum over every completion token of the step, on all
  ranks and micro-batches, over their count (DAPO's token-level mean: a long sample weighs as
  many tokens as it has, with no length bias between samples);
* "grpo" (DeepSeekMath, TRL's loss_type "grpo"): each sample's mean over its tokens, then the mean
  over the step's samples (biased toward short correct and long wrong answers, which Dr. GRPO and
  DAPO point out; offered to reproduce the paper);
* "dr_grpo" (Dr. GRPO): the sum over tokens over (samples x max_completion_length).

All three are a sum over micro-batches and ranks divided by a count known before the step
(`step_count`), so gradient accumulation and data parallelism equal one large batch, as in
next-token training. TRL's dapo normaliser is the generation batch's token count over its
processes, with gradients averaged over processes: the same mean.

The advantages (`group_advantages`) are TRL's with scale_rewards "group" (its default): a
sample's reward minus its group's mean, over the group's standard deviation (Bessel-corrected)
plus 1e-4. With several passes over the same samples (`grpo.passes`, TRL's num_iterations) the
old log-probabilities stay those of the sampling policy, so the ratio and its clipping act from
the second pass on; on the first pass the ratio is 1 (the sampler ran the same weights).

The reported terms are TRL's metric names: `kl` (mean per completion token), `clip_ratio/low_mean`,
`clip_ratio/high_mean`, `clip_ratio/region_mean` (the share of completion tokens whose ratio was
clipped where the clip bounds the objective: below 1 - eps_low with A < 0, above 1 + eps_high with
A > 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_tpu.data.batch import IGNORE_INDEX, Batch, RolloutBatch
from titan_tpu.train.objective import MicroBatchLoss, ModelCalls, StepTerms
from titan_tpu.train.ranks import sum_over_data_parallel

__all__ = ["GRPOObjective", "LOSS_TYPES", "group_advantages", "token_logps"]

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")


def group_advantages(rewards_N: Tensor, *, group_size: int, scale: str = "group",
                     batch_std: Tensor | None = None) -> Tensor:
    """Each sample's advantage [N] from the rewards [N] of consecutive groups of `group_size`
    samples of one prompt: reward - the group's mean, divided by std + 1e-4 where std is the
    group's (scale "group"), the whole batch's ("batch": `batch_std`, the step's on all ranks, by
    default that of `rewards_N`) or not at all ("none"); the standard deviation is
    Bessel-corrected, as TRL's `nanstd`. A group whose rewards are all equal has advantage 0: it
    teaches nothing."""
    assert rewards_N.numel() % group_size == 0, (rewards_N.shape, group_size)
    rewards_GK = rewards_N.float().view(-1, group_size)
    centred_GK = rewards_GK - rewards_GK.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred_GK.flatten()
    if scale == "group":
        std = rewards_GK.std(dim=1, keepdim=True)
    else:
        std = rewards_N.float().std() if batch_std is None else batch_std
    return (centred_GK / (std + 1e-4)).flatten()


def token_logps(logits_BSV: Tensor, labels_BS: Tensor, *, temperature: float = 1.0) -> Tensor:
    """The fp32 log-probability [B, S] of each label under softmax(logits / temperature); 0 where
    the label is IGNORE_INDEX."""
    trained_BS = labels_BS != IGNORE_INDEX
    logp_BSV = (logits_BSV.float() / temperature).log_softmax(dim=-1)
    logp_BS = logp_BSV.gather(-1, torch.where(trained_BS, labels_BS, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(trained_BS, logp_BS, 0.0)


class GRPOObjective:
    name = "grpo"
    terms = ("loss", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")

    def __init__(self, *, epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                 loss_type: str = "dapo", temperature: float = 1.0, max_completion_length: int = 0,
                 kl_correction: bool = True):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"grpo.loss_type = {loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
        self.epsilon_low, self.epsilon_high = epsilon, epsilon_high or epsilon
        self.beta, self.loss_type, self.temperature = beta, loss_type, temperature
        self.max_completion_length, self.kl_correction = max_completion_length, kl_correction

    def frozen_modules(self) -> dict:
        return {}  # the reference's log-probabilities come with the batch (one forward per batch of samples)

    def step_count(self, micro_batches: list[Batch], dp_size: int) -> int:
        """The loss's denominator on all data-parallel ranks (module docstring): completion tokens
        (dapo), samples (grpo) or samples x max_completion_length (dr_grpo). At least 1."""
        if self.loss_type == "dapo":
            local = torch.stack([b.trained_tokens() for b in micro_batches]).sum()
            return max(int(sum_over_data_parallel(local, dp_size).item()), 1)
        samples = sum(b.shape[0] for b in micro_batches) * dp_size
        return samples * (self.max_completion_length if self.loss_type == "dr_grpo" else 1)

    def step_tokens(self, micro_batches: list[Batch], count: int, dp_size: int) -> int:
        """Whole rows (prompt and padding included: the forward reads them)."""
        return sum(b.shape[0] * b.shape[1] for b in micro_batches) * dp_size

    def micro_batch(self, calls: ModelCalls, batch: RolloutBatch, *, count: int | Tensor,
                    share: float) -> MicroBatchLoss:
        logits_BSV = calls.policy(batch.inputs_BS)
        logp_BS = token_logps(logits_BSV, batch.labels_BS, temperature=self.temperature)
        mask_BS = (batch.labels_BS != IGNORE_INDEX).float()
        ratio_BS = torch.exp(logp_BS - batch.old_logps_BS)
        advantage_B1 = batch.advantages_B.float().unsqueeze(1)
        clipped_BS = ratio_BS.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_BS = -torch.min(ratio_BS * advantage_B1, clipped_BS * advantage_B1)
        kl_BS = torch.zeros_like(logp_BS)
        if self.beta != 0.0:
            delta_BS = batch.ref_logps_BS - logp_BS
            kl_BS = torch.exp(delta_BS) - delta_BS - 1
            if self.kl_correction:
                kl_BS = kl_BS * ratio_BS
            per_token_BS = per_token_BS + self.beta * kl_BS
        loss = self._sum(per_token_BS * mask_BS, mask_BS) / count
        with torch.no_grad():
            low_BS = (ratio_BS < 1 - self.epsilon_low) & (advantage_B1 < 0)
            high_BS = (ratio_BS > 1 + self.epsilon_high) & (advantage_B1 > 0)
            sums = torch.stack([(kl_BS.detach() * mask_BS).sum(), (low_BS * mask_BS).sum(), (high_BS * mask_BS).sum(),
                                ((low_BS | high_BS) * mask_BS).sum(), mask_BS.sum()])
        # totals: the loss's share, then token sums the report divides by the step's token count.
        return MicroBatchLoss(loss, torch.cat([loss.detach().view(1), sums]))

    def _sum(self, loss_BS: Tensor, mask_BS: Tensor) -> Tensor:
        if self.loss_type == "grpo":  # each sample's mean over its tokens
            return (loss_BS.sum(dim=1) / mask_BS.sum(dim=1).clamp(min=1.0)).sum()
        return loss_BS.sum()

    def expert_load(self, totals: Tensor) -> Tensor:
        return totals.new_zeros(0, 0)

    def report(self, totals: Tensor) -> StepTerms:
        loss, kl, low, high, region, tokens = totals.tolist()
        tokens = max(tokens, 1.0)
        values = {"loss": loss, "kl": kl / tokens, "clip_ratio/low_mean": low / tokens,
                  "clip_ratio/high_mean": high / tokens, "clip_ratio/region_mean": region / tokens}
        return StepTerms(values, None)

    def example_batch(self, *, batch_size: int, seq_len: int, documents: bool, device: torch.device) -> RolloutBatch:
        zeros = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        return RolloutBatch(zeros, zeros.clone(), torch.zeros(batch_size, device=device),
                            torch.zeros(batch_size, seq_len, device=device),
                            torch.zeros(batch_size, seq_len, device=device) if self.beta else None)
