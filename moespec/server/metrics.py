"""Prometheus collectors on the server's own registry (several servers can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moespec.engine import Engine
from moespec.sequence import Sequence
from moespec.speculation.adaptive import Choice, SpeculationPolicy
from moespec.speculation.tree import TreeShape

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json",
                    "/docs", "/tokenize", "/detokenize", "/tokenizer_info"})  # any other path is counted as "other"


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("moespec_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("moespec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.preemptions = Counter("moespec_preemptions", "Times finished requests were preempted (KV pages ran out)",
                                   registry=r)
        self.prefix_queries = Counter("moespec_prefix_cache_queries",
                                      "Prompt tokens of finished requests looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("moespec_prefix_cache_hits",
                                   "Prompt tokens of finished requests found in the prefix cache", registry=r)
        self.generated_tokens = Counter("moespec_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("moespec_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("moespec_time_per_output_token_seconds", "Mean time per token after the first",
                              registry=r, buckets=LATENCY_BUCKETS)
        self.running = Gauge("moespec_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("moespec_requests_waiting", "Sequences waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("moespec_kv_cache_usage_ratio", "Fraction of KV pages in use", registry=r)
        self.kv_free = Gauge("moespec_kv_pages_free", "Free KV pages", registry=r)
        self.accept_length = Gauge("moespec_spec_accept_length",
                                   "Mean tokens per request per verify step (accepted drafts + 1)", registry=r)
        self.acceptance = Gauge("moespec_spec_acceptance_rate",
                                "Acceptance rate of the draft token at a position (0 = first draft)", ["position"],
                                registry=r)
        self.tree_accept_length = Gauge("moespec_spec_tree_accept_length",
                                        "Mean tokens per request per verify step of a draft tree shape "
                                        "(top_k x depth x draft tokens)", ["shape"], registry=r)
        self.draft_tokens = Gauge("moespec_spec_draft_tokens", "Draft tokens proposed since start", registry=r)
        self.accepted_tokens = Gauge("moespec_spec_accepted_tokens", "Draft tokens accepted since start",
                                     registry=r)
        self.policy_choice = Gauge("moespec_spec_policy_choice",
                                   "1 for the choice adaptive speculation runs at a batch-size bucket (0: plain "
                                   "decoding, k: a chain of k drafts, a tree: its shape), 0 for the others",
                                   ["bucket", "choice"], registry=r)
        self.policy_rate = Gauge("moespec_spec_policy_tokens_per_second",
                                 "Output tokens/s of each choice at a batch-size bucket: as the adaptive policy "
                                 "predicts it and as measured (recent steps that ran it there)",
                                 ["bucket", "choice", "source"], registry=r)
        self.policy_predicted_batch = Gauge("moespec_spec_policy_predicted_batch_size",
                                            "The batch size at which a bucket's predicted tokens/s were made (its "
                                            "last step's)", ["bucket"], registry=r)
        self.policy_explore = Gauge("moespec_spec_policy_explore_steps",
                                    "Steps that ran a speculation choice to measure it rather than because it was "
                                    "predicted fastest", registry=r)
        self.policy_switch_price = Gauge("moespec_spec_policy_switch_seconds_per_position",
                                         "What a switch from plain decoding to drafting costs: seconds of catch-up "
                                         "beyond a steady step per position the draft catches up on (recent switches)",
                                         registry=r)
        self.policy_shifts = Gauge("moespec_spec_policy_acceptance_shifts",
                                   "Times adaptive speculation found recent verify steps' acceptance too far from its "
                                   "running means (a shift in workload) and restarted them from those steps",
                                   registry=r)
        self.rank_running = Gauge("moespec_rank_requests_running", "Sequences in a rank's running batch", ["rank"],
                                  registry=r)
        self.rank_waiting = Gauge("moespec_rank_requests_waiting", "Sequences waiting on a rank", ["rank"],
                                  registry=r)
        self.rank_kv_usage = Gauge("moespec_rank_kv_cache_usage_ratio", "Fraction of a rank's KV pages in use",
                                   ["rank"], registry=r)
        self.rank_kv_free = Gauge("moespec_rank_kv_pages_free", "A rank's free KV pages", ["rank"], registry=r)
        self.expert_balancedness = Gauge("moespec_expert_balancedness",
                                         "Mean over max routed rows per rank of an MoE layer over the last load "
                                         "window (1: balanced)", ["layer"], registry=r)
        self.expert_imbalance = Gauge("moespec_expert_imbalance_ratio",
                                      "(max - mean) / mean routed rows per rank of an MoE layer over the last load "
                                      "window (0: balanced)", ["layer"], registry=r)
        self.expert_rebalances = Gauge("moespec_expert_rebalances", "Live expert rebalances since start (EPLB)",
                                       registry=r)
        self.http = Counter("moespec_http_requests", "HTTP responses by method, route and status",
                            ["method", "route", "status"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_finished(self, reason: str) -> None:
        self.requests.labels(finish_reason=reason).inc()

    def count_http(self, method: str, route: str, status: int) -> None:
        self.http.labels(method=method, route=route, status=str(status)).inc()

    def count_tokens(self, num: int) -> None:
        if num:
            self.generated_tokens.inc(num)

    def observe_finished(self, seq: Sequence) -> None:
        self.count_finished(seq.finish_reason or "unknown")
        self.prompt_tokens.inc(len(seq.prompt_ids))
        if seq.metrics.num_cached_tokens is not None:  # it was scheduled
            self.prefix_queries.inc(len(seq.prompt_ids))
            self.prefix_hits.inc(seq.metrics.num_cached_tokens)
        self.preemptions.inc(seq.metrics.num_preemptions)
        if seq.metrics.ttft is not None:
            self.ttft.observe(seq.metrics.ttft)
        if seq.metrics.tpot is not None:
            self.tpot.observe(seq.metrics.tpot)

    def observe_engine(self, engine: Engine) -> None:
        """Across ranks: requests summed over the ranks, and per rank as of the last step; the KV
        ratio and free pages of rank 0's own cache (every rank's in the per-rank gauges)."""
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(engine.num_waiting())
        self.kv_usage.set(engine.allocator.usage())
        self.kv_free.set(engine.allocator.num_free)
        self.observe_ranks(engine)
        self.observe_experts(engine.lockstep.expert_load() if engine.lockstep is not None else None)
        self.observe_policy(engine.policy)
        spec = engine.spec_stats
        if spec.steps:
            self.accept_length.set(spec.accept_length)
            self.draft_tokens.set(spec.draft_tokens)
            self.accepted_tokens.set(spec.accepted_tokens)
            for position, rate in enumerate(spec.acceptance_by_position()):
                self.acceptance.labels(position=str(position)).set(rate)
            for shape, length in spec.tree_accept_lengths().items():
                self.tree_accept_length.labels(shape=shape).set(length)

    def observe_policy(self, policy: SpeculationPolicy) -> None:
        """Adaptive speculation per batch-size bucket: what runs, predicted and measured tokens/s."""
        if not policy.adaptive:
            return
        self.policy_explore.set(policy.explore_total)
        self.policy_switch_price.set(policy.switch_price)
        self.policy_shifts.set(policy.acceptance.shifts)
        for bucket, state in policy.report().items():
            self.policy_predicted_batch.labels(bucket=str(bucket)).set(state["predicted_batch"])
            for choice in {state["choice"], *state["predicted"], *state["measured"]}:
                labels = {"bucket": str(bucket), "choice": choice_label(choice)}
                self.policy_choice.labels(**labels).set(int(choice == state["choice"]))
            for source in ("predicted", "measured"):
                for choice, rate in state[source].items():
                    self.policy_rate.labels(bucket=str(bucket), choice=choice_label(choice), source=source).set(rate)

    def observe_experts(self, load: dict | None) -> None:
        """Expert-parallel load per MoE layer over the last summed window (parallel/eplb.py)."""
        if load is None:
            return
        self.expert_rebalances.set(load.get("rebalances", 0))
        for layer in load["layers"]:
            self.expert_balancedness.labels(layer=str(layer["layer"])).set(layer["balancedness"])
            self.expert_imbalance.labels(layer=str(layer["layer"])).set(layer["imbalance"])

    def observe_ranks(self, engine: Engine) -> None:
        loads = engine.rank_loads()
        if loads is None:
            return
        if engine.cluster.dp:
            self.running.set(sum(load.running for load in loads))
        for rank, load in enumerate(loads):
            label = str(rank)
            self.rank_running.labels(rank=label).set(load.running)
            self.rank_waiting.labels(rank=label).set(load.waiting)
            self.rank_kv_usage.labels(rank=label).set(load.kv_usage)
            self.rank_kv_free.labels(rank=label).set(load.free_pages)


def choice_label(choice: Choice) -> str:
    return choice.label if isinstance(choice, TreeShape) else str(choice)
