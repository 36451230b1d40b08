"""vLLM's CPU build on the simulated device (HOTLOOP_VLLM_SIM_DEVICE, hotloop.vllm.sim_device): every TP rank's
model runs on it, in vLLM's own queue's arm and in hotloop's queue + engine-core loop's; greedy outputs are the
device's deterministic tokens and identical across the arms; a step lasts at least its modelled time; the device
leaves nothing in /dev/shm.

Needs vLLM; vLLM runs in child processes (``python -m hotloop.bench.vllm_bench --driver``). The two engines start
at once (TP=2 each: forwards cost no CPU, so four workers share the two cores)."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import require_supported_vllm

require_supported_vllm()

from hotloop.bench.vllm_bench import Driver  # noqa: E402
from hotloop.vllm import tiny_model  # noqa: E402

SIM = {"HOTLOOP_VLLM_SIM_DEVICE": "1300+2"}
VOCAB = tiny_model.CONFIG["vocab_size"]
OUTPUT = 48


@pytest.fixture(scope="module")
def engines():
    model = tiny_model.build(0)
    with ThreadPoolExecutor(2) as pool:
        futs = {arm: pool.submit(Driver, 2, arm, model, SIM) for arm in ("vllm", "hotloop+loop")}
        drivers = {arm: f.result() for arm, f in futs.items()}
    results = {}
    try:
        for arm, d in drivers.items():
            results[arm] = {"single": d.generate(1, OUTPUT), "batch": d.generate(6, OUTPUT),
                            "sim": d.sim_device, "queue": d.queue_class}
    finally:
        left = {arm: d.close() for arm, d in drivers.items()}
    yield results, left


def _follows_the_device(ids: list[int]) -> bool:
    """Whether ids[j+1] = (31 ids[j] + 7 (P + j) + 1) mod vocab for one prompt length P (sim_device's logits)."""
    inv7 = pow(7, -1, VOCAB)
    p = ((ids[1] - 31 * ids[0] - 1) * inv7) % VOCAB
    return all(ids[j + 1] == (31 * ids[j] + 7 * (p + j) + 1) % VOCAB for j in range(len(ids) - 1))


def test_every_rank_runs_on_the_simulated_device(engines):
    results, _ = engines
    for arm, r in results.items():
        ranks = sorted((w["rank"], w["world"]) for w in r["sim"] if w)
        assert ranks == [(0, 2), (1, 2)], f"{arm}: the workers' devices are {r['sim']}"
        assert all(w["base_us"] == 1300 and w["per_token_us"] == 2 for w in r["sim"])


def test_greedy_outputs_are_the_devices_and_identical_across_arms(engines):
    results, _ = engines
    for arm, r in results.items():
        for shape in ("single", "batch"):
            assert "error" not in r[shape], f"{arm} {shape}: {r[shape]}"
            assert all(len(ids) == OUTPUT and _follows_the_device(ids) for ids in r[shape]["token_ids"]), \
                f"{arm} {shape}: outputs are not the simulated device's"
        batch = r["batch"]["token_ids"]
        assert len({tuple(ids) for ids in batch}) > 1, "every request got the same tokens: a mix-up would not show"
    assert results["vllm"]["single"]["token_ids"] == results["hotloop+loop"]["single"]["token_ids"]
    assert results["vllm"]["batch"]["token_ids"] == results["hotloop+loop"]["batch"]["token_ids"]


def test_a_step_takes_at_least_its_modelled_time(engines):
    results, _ = engines
    for arm, r in results.items():
        # one request: a prefill step then OUTPUT - 1 decode steps of 1 token, each >= 1.302 ms on the device
        floor = (OUTPUT - 1) * 1.302e-3
        assert r["single"]["wall_s"] >= floor, f"{arm}: {r['single']['wall_s']:.3f} s for {OUTPUT} tokens"


def test_nothing_is_left(engines):
    _, left = engines
    assert left == {"vllm": {}, "hotloop+loop": {}}
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("hotloop.devclock.")]
