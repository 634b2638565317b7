"""The benchmarks' account of the host: each core's busy and stolen share between two /proc/stat reads."""

from bench import footprint


def test_host_load_splits_each_cores_time_into_busy_and_stolen_shares():
    #           user nice sys idle iowait irq softirq steal
    before = {"cpu0": [100, 0, 50, 800, 10, 0, 0, 40], "cpu1": [0] * 8}
    after = {"cpu0": [160, 0, 70, 810, 10, 5, 5, 60], "cpu1": [50, 0, 0, 50, 0, 0, 0, 0]}
    load = footprint.host_load(before, after)
    # cpu0: 60 + 20 + 5 + 5 = 90 busy, 20 stolen, 10 idle of 120 ticks.
    assert load["busy_pct"] == {"cpu0": 75.0, "cpu1": 50.0}
    assert load["steal_pct"] == {"cpu0": 16.7, "cpu1": 0.0}
    assert load["mean_steal_pct"] == 9.1  # 20 of the 220 ticks both cores had
    assert footprint.describe_host_load(load).startswith("cpu0 75% busy, cpu1 50% busy; the hypervisor took")


def test_host_times_reads_every_core_of_this_machine():
    cores = footprint.host_times()
    assert cores and all(name.startswith("cpu") for name in cores)
    assert all(len(t) == 8 and all(x >= 0 for x in t) for t in cores.values())
    idle = footprint.host_load(cores, cores)
    assert set(idle["busy_pct"].values()) == {0.0}
