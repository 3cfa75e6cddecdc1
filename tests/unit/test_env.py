"""ncclkv._env: defaults, parsing, and errors that name the variable."""

from __future__ import annotations

import pytest

from ncclkv._env import EnvSettings, env_settings, take_bind_host_auto


def test_defaults_are_values_not_descriptors() -> None:
    settings = env_settings({})
    assert settings == EnvSettings()
    assert (settings.deadline_s, settings.heartbeat_s, settings.bind_host) == (10.0, 1.0, "127.0.0.1")
    assert settings.staging_bytes == 1 << 30 and settings.max_frame_bytes == 1 << 20
    assert settings.wire_cache_bytes == 256 << 20
    assert settings.paged_kernel == "native"
    assert settings.copy_threads == 1
    assert env_settings({"NCCLKV_COPY_THREADS": "16"}).copy_threads == 16
    assert env_settings({"NCCLKV_PAGED_KERNEL": "torch"}).paged_kernel == "torch"


def test_variables_override() -> None:
    settings = env_settings({"NCCLKV_DEADLINE_S": "2.5", "NCCLKV_BIND_HOST": "10.1.2.3",
                             "NCCLKV_STAGING_BYTES": "4096", "NCCLKV_HEARTBEAT_S": "0.25",
                             "NCCLKV_WIRE_CACHE_BYTES": "8192"})
    assert (settings.deadline_s, settings.bind_host, settings.staging_bytes, settings.heartbeat_s,
            settings.wire_cache_bytes) == (2.5, "10.1.2.3", 4096, 0.25, 8192)
    assert env_settings({"NCCLKV_WIRE_CACHE_BYTES": "0"}).wire_cache_bytes == 0  # keep no free buffer


@pytest.mark.parametrize(
    ("name", "value"),
    [("NCCLKV_DEADLINE_S", "soon"), ("NCCLKV_DEADLINE_S", "0"), ("NCCLKV_STAGING_BYTES", "1.5"),
     ("NCCLKV_STAGING_BYTES", "-1"), ("NCCLKV_MAX_FRAME_BYTES", "big"), ("NCCLKV_PAGED_KERNEL", "fast"),
     ("NCCLKV_WIRE_CACHE_BYTES", "lots"), ("NCCLKV_HEARTBEAT_S", "nan"), ("NCCLKV_DEADLINE_S", "inf"),
     ("NCCLKV_DEADLINE_S", "-inf"), ("NCCLKV_WIRE_CACHE_BYTES", "-1"), ("NCCLKV_STAGING_BYTES", "0"),
     ("NCCLKV_COPY_THREADS", "0"), ("NCCLKV_COPY_THREADS", "17"), ("NCCLKV_COPY_THREADS", "two"),
     ("NCCLKV_DEADLINE_S", "2e9"), ("NCCLKV_HEARTBEAT_S", "2e9")],  # past MAX_TIMEOUT_S: no wait takes it
)
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError) as err:
        env_settings({name: value})
    assert name in str(err.value) and repr(value) in str(err.value)


def test_bind_host_auto_is_taken_out_of_the_environment_only_when_it_is_auto() -> None:
    environ = {"NCCLKV_BIND_HOST": " Auto ", "OTHER": "1"}
    assert take_bind_host_auto(environ) is True
    assert environ == {"OTHER": "1"}  # env_settings() after it no longer sees a value it would refuse
    env_settings(environ)
    for kept in ({"NCCLKV_BIND_HOST": "10.0.0.5"}, {}):
        before = dict(kept)
        assert take_bind_host_auto(kept) is False and kept == before
