"""Admission: how many requests a replica takes at once, at the router and in vLLM itself.

- The router sends one replica at most ``maxconn`` requests at once (HAProxy's server ``maxconn``); the others
  wait in the router's queue of the model's backend, at most ``router_queue_timeout_s``, then get 503 with
  ``Retry-After``. From the plan, ``maxconn`` is the sequences at ``max_model_len`` the replica's KV cache holds on
  each data-parallel rank (whole ones: a request the cache can hold at full length is never preempted for lack
  of it), at most the sequences vLLM schedules at once on a rank (``--max-num-seqs``: more would only wait in
  vLLM's queue instead of the router's), times the ranks: one router server stands for the whole replica, whose
  API server spreads requests over its ranks. With ``router_typical_request_tokens``, the sequences counted are
  of that length instead (most requests are far shorter than ``max_model_len``: a 70B model at 32k takes 13 at
  once at full length); a request longer than that may then be preempted for lack of cache, as vLLM does under
  load. Where a bench record of the replica's model and shape (``gpufleet bench``; of its release, else of the
  newest other, named as such) found a ceiling bounded by a failing step, ``maxconn`` is the most requests vLLM ran
  at once on one replica in the ceiling's step
  instead (:func:`measured`: what the replica served within the objective, at the lengths the bench sent), held to
  vLLM's own valve below. ``router_server_maxconn`` replaces both.
- vLLM's own valve, ``--max-num-queued-reqs``, counts the requests a replica holds, running and waiting, across
  its ranks, and answers 503 beyond it. By default it is ``QUEUE_FACTOR`` times the router's ``maxconn``: what
  one router admits and as much again (a second router sending at the same time, or clients that reach the
  replica directly). ``vllm_max_num_queued_reqs`` replaces it. A vLLM release whose catalog lacks the flag gets
  none. A bench record does not move it: it is an engine flag, and a new record must not restart every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpufleet.config.schema import HostConfig
from gpufleet.plan.model_memory import KvBudget
from gpufleet.values.vllm_flags import FlagCatalog

QUEUED_REQS_FLAG = "--max-num-queued-reqs"
QUEUE_FACTOR = 2
"""vLLM's default limit of requests held, as a multiple of the router's maxconn for the replica."""


class UnsupportedLimitError(ValueError):
    """``vllm_max_num_queued_reqs`` set for a vLLM release that has no ``--max-num-queued-reqs``."""


class TypicalLengthError(ValueError):
    """``router_typical_request_tokens`` above the replicas' ``max_model_len``."""


@dataclass(frozen=True)
class Admission:
    """One replica's admission figures."""

    planned: int  # requests at once, from the plan (see planned_concurrency)
    maxconn: int  # the router's maxconn for the replica: router_server_maxconn, else planned
    queued_reqs: int | None  # vLLM's --max-num-queued-reqs; None: its release has no such flag
    priority: bool = False  # vLLM schedules the waiting requests by priority (gpufleet.plan.priority), not by arrival
    usage: bool = False  # every answer reports its usage, streamed ones too (gpufleet.plan.token_budgets)
    sized_at: int | None = None  # the request length planned is sized for (router_typical_request_tokens); None: max
    fixed: bool = False  # maxconn is router_server_maxconn's
    measured: str | None = None  # maxconn is a bench record's (measured): which, as the plan shows it

    @property
    def basis(self) -> str:
        """What maxconn comes from, as the plan shows it."""
        if self.fixed:
            return "set (router_server_maxconn)"
        if self.measured is not None:
            return self.measured
        return "at max_model_len" if self.sized_at is None else f"at {self.sized_at:,} tokens"

    def cell(self) -> str:
        """The figures as ``gpufleet plan``'s table shows them, one a line."""
        queued = "unlimited" if self.queued_reqs is None else f"{self.queued_reqs:,}"
        return (f"maxconn {self.maxconn:,}\n{self.basis}\nqueued {queued}"
                + ("\nby priority" if self.priority else ""))


def planned_concurrency(budget: KvBudget, max_num_seqs: int, dp: int, typical_tokens: int | None = None) -> int:
    """Requests one replica takes at once: whole sequences at max_model_len per rank (``typical_tokens``: of that
    length), at most ``max_num_seqs`` (vLLM's per-rank batch), times the ``dp`` ranks; at least 1."""
    if max_num_seqs < 1 or dp < 1:
        raise ValueError(f"max_num_seqs and dp must be >= 1, got {max_num_seqs} and {dp}")
    sequences = budget.full_sequences if typical_tokens is None else budget.sequences_at(typical_tokens)
    return dp * max(1, min(sequences, max_num_seqs))


def admission(cfg: HostConfig, budget: KvBudget, max_num_seqs: int, dp: int, catalog: FlagCatalog) -> Admission:
    """A replica's figures from its pool's config, its KV budget per rank, vLLM's batch size per rank, its ranks
    and its release's catalog. Raises UnsupportedLimitError when ``vllm_max_num_queued_reqs`` is set for a release
    that has no such flag, TypicalLengthError when ``router_typical_request_tokens`` is above ``max_model_len``."""
    typical = cfg.router_typical_request_tokens
    if typical is not None and typical > budget.tokens_per_sequence:
        raise TypicalLengthError(f"expected at most max_model_len, {budget.tokens_per_sequence:,} tokens, found"
                                 f" {typical:,}")
    planned = planned_concurrency(budget, max_num_seqs, dp, typical)
    maxconn = cfg.router_server_maxconn or planned
    fixed = cfg.router_server_maxconn is not None
    if not catalog.has(QUEUED_REQS_FLAG):
        if cfg.vllm_max_num_queued_reqs is not None:
            raise UnsupportedLimitError(f"expected null with vLLM {catalog.version} (it has no"
                                        f" {QUEUED_REQS_FLAG}), found {cfg.vllm_max_num_queued_reqs}")
        return Admission(planned, maxconn, None, sized_at=typical, fixed=fixed)
    return Admission(planned, maxconn, cfg.vllm_max_num_queued_reqs or QUEUE_FACTOR * maxconn, sized_at=typical,
                     fixed=fixed)


def measured(found: Admission, running: int, source: str) -> Admission:
    """``found`` with the router's maxconn from a bench: ``running`` requests at once on one replica at the ceiling
    (``source``: the record, as the plan names it), at most vLLM's valve; ``found`` itself where maxconn is set."""
    if found.fixed or running < 1:
        return found
    held = found.queued_reqs is not None and running > found.queued_reqs
    maxconn = found.queued_reqs if held and found.queued_reqs is not None else running
    return replace(found, maxconn=maxconn, measured=f"measured: {running:,} at the ceiling ({source})"
                   + (f", held to vLLM's queue limit {maxconn:,}" if held else ""))
