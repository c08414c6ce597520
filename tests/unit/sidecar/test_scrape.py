"""Engine /metrics pages into LoadReports: vLLM's names (the mapping of
admission.proto), deltas for counters and histograms, the SGLang and TGI
presets and overrides."""

from __future__ import annotations

import pytest
from burstgate_client.sidecar.config import EngineKind, MetricsSettings
from burstgate_client.sidecar.scrape import LoadReader, parse


def vllm_page(
    *, waiting: float, running: float, kv: float, iter_sum: float, iter_count: float,
    hits: float, queries: float, kv_name: str = "vllm:kv_cache_usage_perc",
) -> str:  # fmt: skip
    labels = '{engine="0",model_name="m"}'
    return f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{labels} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{labels} {waiting}
# TYPE {kv_name} gauge
{kv_name}{labels} {kv}
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{labels} {queries}
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{labels} 1.7e9
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{labels} {hits}
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{{engine="0",le="1.0",model_name="m"}} 0.0
vllm:iteration_tokens_total_bucket{{engine="0",le="+Inf",model_name="m"}} {iter_count}
vllm:iteration_tokens_total_count{labels} {iter_count}
vllm:iteration_tokens_total_sum{labels} {iter_sum}
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} 3.0
vllm:time_to_first_token_seconds_count{labels} 3.0
vllm:time_to_first_token_seconds_sum{labels} 0.3
"""


def reader(**kw: object) -> LoadReader:
    return LoadReader(MetricsSettings.model_validate(kw), pool="gpu-a", engine_id="e0")


def test_vllm_gauges_and_deltas() -> None:
    r = reader(max_batch_tokens=4096, max_num_seqs=128)
    first = r.report(vllm_page(waiting=3, running=7, kv=0.42, iter_sum=1000, iter_count=10,
                               hits=100, queries=400))  # fmt: skip
    assert first is not None
    assert (first.pool, first.engine_id, first.queue_depth, first.requests_running) == (
        "gpu-a", "e0", 3, 7)
    assert first.kv_cache_usage == pytest.approx(0.42)
    assert first.max_batch_tokens == 4096 and first.max_num_seqs == 128
    assert first.queue_capacity == 0
    assert first.batch_tokens == 0  # no interval yet
    assert not first.HasField("kv_cache_miss_rate")  # not measured: left out
    second = r.report(vllm_page(waiting=0, running=2, kv=0.1, iter_sum=1600, iter_count=13,
                                hits=250, queries=600))  # fmt: skip
    assert second is not None
    assert second.batch_tokens == 200  # (1600 - 1000) / (13 - 10)
    assert second.kv_cache_miss_rate == pytest.approx(0.25)  # 1 - 150 / 200
    idle = r.report(vllm_page(waiting=0, running=0, kv=0, iter_sum=1600, iter_count=13,
                              hits=250, queries=600))  # fmt: skip
    assert idle is not None and idle.batch_tokens == 0
    assert not idle.HasField("kv_cache_miss_rate")  # no queries in the interval


def test_a_restarted_engine_counts_from_zero_and_old_names_work() -> None:
    r = reader()
    r.report(vllm_page(waiting=1, running=1, kv=0.5, iter_sum=5000, iter_count=50, hits=900,
                       queries=1000))  # fmt: skip
    after = r.report(vllm_page(waiting=1, running=1, kv=0.5, iter_sum=300, iter_count=3, hits=10,
                               queries=40, kv_name="vllm:gpu_cache_usage_perc"))  # fmt: skip
    assert after is not None and after.batch_tokens == 100
    assert after.kv_cache_miss_rate == pytest.approx(0.75)
    assert after.kv_cache_usage == pytest.approx(0.5)  # the older metric name


def test_series_are_summed_and_kv_usage_averaged() -> None:
    page = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 2
vllm:num_requests_waiting{engine="1"} 5
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.6
"""
    got = reader(max_num_seqs=None).report(page)
    assert got is not None and got.queue_depth == 7
    assert not got.HasField("max_num_seqs")  # unknown: not sent
    assert got.kv_cache_usage == pytest.approx(0.4)
    assert not got.HasField("requests_running")


def test_no_queue_depth_no_report() -> None:
    running = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
    assert reader().report(running) is None
    assert reader().report("") is None


def test_sglang_and_tgi_presets() -> None:
    sglang = reader(engine=EngineKind.SGLANG).report("""# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 4
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 9
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.28
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.75
""")
    assert sglang is not None and (sglang.queue_depth, sglang.requests_running) == (4, 9)
    assert sglang.kv_cache_usage == pytest.approx(0.28)
    assert sglang.kv_cache_miss_rate == pytest.approx(0.25)
    tgi = reader(engine=EngineKind.TGI, queue_capacity=128).report("""# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 12
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 3000
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0"} 90
DCGM_FI_DEV_GPU_UTIL{gpu="1"} 70
""")
    assert tgi is not None and (tgi.queue_depth, tgi.requests_running) == (6, 12)
    assert tgi.batch_tokens == 3000 and tgi.queue_capacity == 128
    assert tgi.gpu_utilization == pytest.approx(0.8)  # percent, averaged
    assert not tgi.HasField("kv_cache_usage")


def test_names_override_the_preset_and_values_are_bounded() -> None:
    r = reader(names={"queue_depth": ["missing_metric", "my_waiting"], "kv_cache_usage": "my_kv"})
    got = r.report("my_waiting 3e13\nmy_kv 1.7\n")  # untyped lines are gauges
    assert got is not None and got.queue_depth == 10**12 and got.kv_cache_usage == 1.0


def test_counters_typed_without_their_suffix_are_read_too() -> None:
    r = reader()
    page = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
    counters = "# TYPE vllm:prefix_cache_{0} counter\nvllm:prefix_cache_{0}_total {1}\n"
    r.report(page + counters.format("hits", 1) + counters.format("queries", 2))
    got = r.report(page + counters.format("hits", 3) + counters.format("queries", 10))
    assert got is not None and got.kv_cache_miss_rate == pytest.approx(0.75)
    # with labels, the parser gives each series a family of its own: summed
    two = ("# TYPE vllm:prefix_cache_{0} counter\n"
           "vllm:prefix_cache_{0}_total{{engine=\"0\"}} {1}\n"
           "vllm:prefix_cache_{0}_total{{engine=\"1\"}} 7\n")  # fmt: skip
    r.report(page + two.format("hits", 3) + two.format("queries", 10))
    got = r.report(page + two.format("hits", 4) + two.format("queries", 14))
    assert got is not None and got.kv_cache_miss_rate == pytest.approx(0.75)  # 1 - 1 / 4


def test_parse_keeps_only_the_wanted_lines() -> None:
    page = vllm_page(waiting=1, running=2, kv=0, iter_sum=0, iter_count=0, hits=0, queries=0)
    got = parse(page, {"vllm:num_requests_waiting"}, {"vllm:num_requests_waiting"})
    assert set(got) == {"vllm:num_requests_waiting"} and got["vllm:num_requests_waiting"].value == 1


def sglang_page(*, prompt: dict[str, float], cached: dict[str, float], hit_rate: float) -> str:
    """SGLang's page as prometheus_client writes it (the classic text format
    types a counter with its ``_total``): prompt tokens by ``is_streaming``,
    cached ones by ``cache_source``."""
    lines = ["# TYPE sglang:num_queue_reqs gauge", 'sglang:num_queue_reqs{model_name="m"} 0',
             "# TYPE sglang:cache_hit_rate gauge",
             f'sglang:cache_hit_rate{{model_name="m"}} {hit_rate}',
             "# TYPE sglang:prompt_tokens_total counter"]  # fmt: skip
    lines += [f'sglang:prompt_tokens_total{{is_streaming="{k}",model_name="m"}} {v}'
              for k, v in prompt.items()]  # fmt: skip
    lines.append("# TYPE sglang:cached_tokens_total counter")
    lines += [f'sglang:cached_tokens_total{{cache_source="{k}",model_name="m"}} {v}'
              for k, v in cached.items()]  # fmt: skip
    return "\n".join(lines) + "\n"


def test_sglang_counters_give_the_interval_rate_and_its_gauge_is_not_read_beside_them() -> None:
    r = reader(engine=EngineKind.SGLANG)
    r.report(sglang_page(prompt={"false": 1000, "true": 0}, cached={"device": 500}, hit_rate=0.9))
    got = r.report(sglang_page(prompt={"false": 1600, "true": 400}, cached={"device": 700,
                               "host": 100}, hit_rate=0.9))  # fmt: skip
    # 1000 prompt tokens in the interval, 300 of them cached (device + host)
    assert got is not None and got.kv_cache_miss_rate == pytest.approx(0.7)
    idle = r.report(sglang_page(prompt={"false": 1600, "true": 400}, cached={"device": 700,
                                "host": 100}, hit_rate=0.9))  # fmt: skip
    # no prompt in the interval: unset, not the last batch's 0.9 hit rate
    assert idle is not None and not idle.HasField("kv_cache_miss_rate")


def test_a_restart_resets_both_prefix_counters_together() -> None:
    r = reader()
    r.report(vllm_page(waiting=0, running=0, kv=0, iter_sum=0, iter_count=0, hits=10,
                       queries=100))  # fmt: skip
    # restarted: queries went down (100 -> 40) while hits went up (10 -> 30);
    # both count from zero, so 30 of 40, not (30 - 10) of 40
    got = r.report(vllm_page(waiting=0, running=0, kv=0, iter_sum=0, iter_count=0, hits=30,
                             queries=40))  # fmt: skip
    assert got is not None and got.kv_cache_miss_rate == pytest.approx(0.25)


def test_untyped_total_lines_and_the_v0_hit_rate_gauge() -> None:
    r = reader()
    page = "vllm:num_requests_waiting 0\nvllm:prefix_cache_hits_total {}\n" \
           "vllm:prefix_cache_queries_total {}\n"  # fmt: skip
    r.report(page.format(0, 0))
    got = r.report(page.format(60, 80))
    assert got is not None and got.kv_cache_miss_rate == pytest.approx(0.25)
    v0 = reader().report("vllm:num_requests_waiting 1\nvllm:gpu_prefix_cache_hit_rate 0.4\n")
    assert v0 is not None and v0.kv_cache_miss_rate == pytest.approx(0.6)
