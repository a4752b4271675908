"""Odds ratio preference optimisation (Hong et al., 2024, ORPO) as an objective (train/objective.py).

A micro-batch is a `PreferenceBatch`, as DPO's: B prompts, each with a chosen and a rejected
completion, labels on the completion tokens only. There is no reference model: the policy scores
both completions as the mean log-probability of their tokens, logp_c and logp_r, in one forward of
the 2B rows; with log odds(p) = log p - log(1 - p) taken on those means (log(1 - exp(x)) computed
stably, `log1mexp`),

    log_odds = (logp_c - logp_r) - (log1mexp(logp_c) - log1mexp(logp_r))
    loss = NLL(chosen) - mean over pairs of beta * log sigmoid(log_odds)

These are TRL's ORPOTrainer formulas (trl 1.16, trl.experimental.orpo: `odds_ratio_loss`,
`get_batch_logps(average_log_prob=True)`, `concatenated_forward`), and its metrics: rewards/chosen
= beta * logp_c and rewards/rejected = beta * logp_r (means over pairs), rewards/margins,
rewards/accuracies, logps/chosen, logps/rejected (the mean log-probabilities), nll_loss,
log_odds_ratio (the mean of log sigmoid(log_odds)) and log_odds_chosen (the mean of log_odds).
TRL's logits/chosen and logits/rejected are not reported: the loss kernel never forms the logits.

The NLL is TRL's: the chosen rows' cross-entropy over their prompt and completion tokens (TRL's
`concatenated_forward` labels every token the attention mask keeps), which costs a second forward
of the chosen rows with the prompt's labels (3B rows a micro-batch, not 2B). With
`nll_includes_prompt=False` it is the completion's alone, as the paper writes it, in the one
forward of 2B rows.

The two terms have two denominators and the contract one (`step_count`): the count is the NLL's
tokens in the step on all ranks (so the NLL is the step's token mean, as next-token training's),
and the pairs' mean is a micro-batch's sum times `share` / B (every micro-batch on every rank holds
B pairs: the step's pairs are B / share). So accumulation and data parallelism equal one large
batch; TRL, whose NLL is each micro-batch's token mean averaged over micro-batches and processes,
equals it for one micro-batch on one process. A validation batch (a count of 1, share 0) reports
sums: the loss is the summed NLL plus the summed pair losses, nll_loss the summed NLL,
log_odds_ratio and the other pair terms sums over its pairs. An MoE model's balancing loss is
added as in next-token training (the first forward's: TRL's aux loss is that of the 2B rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_tpu.data.batch import IGNORE_INDEX, Batch, PreferenceBatch, TokenBatch
from titan_tpu.train.objective import MicroBatchLoss, ModelCalls, StepTerms, terms_then_loads
from titan_tpu.train.ranks import sum_over_data_parallel

__all__ = ["ORPOObjective", "log1mexp", "prompt_labels"]


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, branching at -ln 2 as TRL does (each branch exact where it is used)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def prompt_labels(rows: TokenBatch) -> Tensor:
    """The next token of each prompt position of `rows` (those before the first completion label),
    IGNORE_INDEX elsewhere: with the completion's labels, every target of the row but its padding."""
    trained_BS = rows.labels_BS != IGNORE_INDEX
    before_BS = (trained_BS.cumsum(-1) == 0) & trained_BS.any(-1, keepdim=True)
    # The last position's next token is its label; it is never a prompt position of a row with a completion.
    next_BS = torch.cat([rows.inputs_BS[:, 1:], rows.labels_BS[:, -1:]], dim=1)
    return torch.where(before_BS, next_BS, IGNORE_INDEX)


class ORPOObjective:
    name = "orpo"
    terms = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
             "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen", "aux_loss")

    def __init__(self, *, beta: float, nll_includes_prompt: bool = True):
        self.beta, self.nll_includes_prompt = beta, nll_includes_prompt
        self.load_shape: torch.Size | None = None  # the expert loads' shape, known once a forward ran

    def frozen_modules(self) -> dict[str, nn.Module]:
        return {}

    def nll_tokens(self, batch: PreferenceBatch) -> Tensor:
        """The chosen rows' targets the NLL sums over (0-dim)."""
        count = batch.chosen.trained_tokens()
        if self.nll_includes_prompt:
            count = count + (prompt_labels(batch.chosen) != IGNORE_INDEX).sum()
        return count

    def step_count(self, micro_batches: list[Batch], dp_size: int) -> int:
        """The NLL's tokens in the step's micro-batches on all data-parallel ranks (at least 1)."""
        counts = torch.stack([self.nll_tokens(b) for b in micro_batches]).sum()
        return max(int(sum_over_data_parallel(counts, dp_size).item()), 1)

    def step_tokens(self, micro_batches: list[Batch], count: int, dp_size: int) -> int:
        """The rows the forwards read, whole (padding included): 2 per pair, 3 with the prompt's NLL."""
        rows = (3 if self.nll_includes_prompt else 2) * sum(b.shape[0] for b in micro_batches) * dp_size
        return rows * micro_batches[0].shape[1]

    def micro_batch(self, calls: ModelCalls, batch: PreferenceBatch, *, count: int | Tensor,
                    share: float) -> MicroBatchLoss:
        B = batch.shape[0]
        # Chosen rows then rejected rows: one forward of the policy for both completions.
        tokens_BS = torch.cat([batch.chosen.inputs_BS, batch.rejected.inputs_BS])
        labels_BS = torch.cat([batch.chosen.labels_BS, batch.rejected.labels_BS])
        out = calls.policy(tokens_BS, labels_BS, per_sequence=True)
        lengths_B = (labels_BS != IGNORE_INDEX).sum(-1).clamp(min=1)
        logps_B = -out.ce_sum / lengths_B  # each completion's mean log-probability per token
        chosen_B, rejected_B = logps_B[:B], logps_B[B:]
        nll_sum = out.ce_sum[:B].sum()
        if self.nll_includes_prompt:
            prompt_BS = prompt_labels(batch.chosen)
            nll_sum = nll_sum + calls.policy(batch.chosen.inputs_BS, prompt_BS, per_sequence=True).ce_sum.sum()
        log_odds_B = (chosen_B - rejected_B) - (log1mexp(chosen_B) - log1mexp(rejected_B))
        ratio_B = F.logsigmoid(log_odds_B)
        # A pair's weight in the step's mean over pairs: B / share pairs in the step; a validation
        # batch (share 0) sums.
        per_pair = share / B if share else 1.0
        nll = nll_sum / count  # count may be a graph input, not a traced constant
        loss = nll - self.beta * ratio_B.sum() * per_pair
        aux = out.aux_loss * share
        chosen_reward_B, rejected_reward_B = self.beta * chosen_B.detach(), self.beta * rejected_B.detach()
        pair_terms = torch.stack([chosen_reward_B.sum(), rejected_reward_B.sum(),
                                  (chosen_reward_B > rejected_reward_B).float().sum(),
                                  (chosen_reward_B - rejected_reward_B).sum(), chosen_B.detach().sum(),
                                  rejected_B.detach().sum()]) * per_pair
        odds_terms = torch.stack([ratio_B.detach().sum(), log_odds_B.detach().sum()]) * per_pair
        self.load_shape = out.expert_load.shape
        totals = torch.cat([loss.detach().view(1), pair_terms, nll.detach().view(1), odds_terms,
                            aux.detach().view(1), out.expert_load.flatten()])
        return MicroBatchLoss(loss + aux, totals)

    def expert_load(self, totals: Tensor) -> Tensor:
        return totals[len(self.terms):].view(self.load_shape)

    def report(self, totals: Tensor) -> StepTerms:
        return terms_then_loads(self.terms, totals, self.load_shape)

    def validation_sums(self, batch: PreferenceBatch, totals: Tensor) -> Tensor:
        """The summed NLL and its tokens, the summed log sigmoid of the log odds and the pairs (a
        count of 1 and share 0 sum every term)."""
        nll, ratio = totals[self.terms.index("nll_loss")], totals[self.terms.index("log_odds_ratio")]
        return torch.stack([nll, self.nll_tokens(batch).to(totals.dtype), ratio,
                            torch.tensor(float(batch.shape[0]), device=totals.device)])

    def validation_loss(self, sums: Tensor) -> Tensor:
        """As the step's loss: the NLL's token mean minus beta x the pairs' mean log sigmoid of the log odds."""
        return sums[0] / sums[1].clamp(min=1) - self.beta * sums[2] / sums[3].clamp(min=1)

    def example_batch(self, *, batch_size: int, seq_len: int, documents: bool, device: torch.device) -> PreferenceBatch:
        def rows() -> TokenBatch:
            return TokenBatch(torch.zeros(batch_size, seq_len, dtype=torch.long, device=device),
                              torch.zeros(batch_size, seq_len, dtype=torch.long, device=device))

        return PreferenceBatch(rows(), rows())
