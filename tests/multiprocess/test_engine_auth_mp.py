"""Transfer engines with authentication on, across real processes (issue 9 part 4).

Every engine here has a CURVE key pair and a shared secret (``EngineConfig.auth``;
a deployment sets the NCCLKV_CURVE_* / NCCLKV_SHARED_SECRET* variables instead,
docs/SECURITY.md). Authenticated engines pull and push byte-exact. An engine
without the credentials, or with wrong ones, gets no handshake: it loses the
producer at once, told why (PeerAuthError naming the keys or the secret), and
the producer counts the refused frames or connection, knows no such peer,
sent nothing, and goes on serving the engines that belong.
"""

from __future__ import annotations

import pytest
import zmq

from ncclkv.auth import ChannelAuth, CurveConfig
from ncclkv.engine import EngineRef
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.paged import CacheLayout

from _engine_pool import Pool, Proc, blocks, build_engine
from _engine_workers import Req

pytestmark = pytest.mark.multiprocess

GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
DEADLINE_S = 3.0
SECRET = bytes(range(32))
_public, DEPLOYMENT_KEY = zmq.curve_keypair()  # one key pair for the whole deployment
_other_public, STRANGER_KEY = zmq.curve_keypair()
GOOD = ChannelAuth(curve=CurveConfig.from_secret_key(DEPLOYMENT_KEY), shared_secret=SECRET)
INTRUDERS = {
    "no-auth": ChannelAuth(),
    "wrong-secret": ChannelAuth(curve=CurveConfig.from_secret_key(DEPLOYMENT_KEY), shared_secret=b"w" * 32),
    # It knows the deployment's public key (public, after all) but holds a key pair of its own.
    "stranger-curve-key": ChannelAuth(curve=CurveConfig.from_secret_key(STRANGER_KEY, server_key=_public),
                                      shared_secret=SECRET),
}
# What each one is told, at once (before, its request waited out the deadline, or was told "send failed").
TOLD = {
    # At once, or at deadline_s: which side of the ZMQ handshake sees the mechanisms differ first is a race
    "no-auth": "CURVE while this channel does not",
    "wrong-secret": "refused our frames as not authenticated: its shared secret differs from ours",
    "stranger-curve-key": "it is not among its allowed clients (NCCLKV_CURVE_ALLOWED_KEYS",
}


def _build(proc: Proc, engine_id: str, role: str, auth: ChannelAuth, **config: object) -> EngineRef:
    return build_engine([proc], engine_id, ParallelLayout(1, 1), GEOMETRY, CacheLayout.CPU, 16, role,
                        deadline_s=DEADLINE_S, num_blocks=64, auth=auth, **config)


def _req(rid: str, seed: int, slot: int) -> Req:
    return Req(rid, seed, 40, blocks(40, 16, 4 * slot), blocks(40, 16, 4 * slot))


def _pulled(producer: Proc, consumer: Proc, ref_p: EngineRef, key_d: str, req: Req) -> None:
    producer.call("hold", key=ref_p.engine_id, reqs=[req])
    consumer.call("expect", key=key_d, producer=ref_p, reqs=[req])
    outcome = consumer.call("wait", key=key_d, reqs=[req])[req.rid]
    assert outcome.ok, outcome


def test_authenticated_engines_pull_and_push_byte_exact(procs: Pool) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, "auth-p", "producer", GOOD)
    ref_c = _build(consumer, "auth-d", "consumer", GOOD)
    _pulled(producer, consumer, ref_p, "auth-d", _req("pulled", 1, 0))
    pushed = _req("pushed", 2, 1)
    consumer.call("expect", key="auth-d", producer=ref_p, reqs=[pushed], push=True)
    assert producer.call("push", key="auth-p", req=pushed, consumer=ref_c).ok
    assert consumer.call("wait", key="auth-d", reqs=[pushed])["pushed"].ok
    stats = producer.call("stats", key="auth-p")
    # The pull's layers in one tensor (pull_batch_bytes), the push's a tensor per layer.
    assert stats["tensors_sent"] == 1 + GEOMETRY.num_layers and stats["channel"]["auth_failures"] == 0, stats
    assert stats["peers"] == ["auth-d.r0"], stats


@pytest.mark.parametrize("intruder", sorted(INTRUDERS))
def test_engine_without_the_credentials_gets_no_handshake_and_no_link(procs: Pool, intruder: str) -> None:
    producer, stranger, member = procs[0], procs[1], procs[2]
    ref_p = _build(producer, "guarded-p", "producer", GOOD)
    _build(stranger, "stranger-d", "consumer", INTRUDERS[intruder])
    lure = _req("lure", 3, 0)
    producer.call("hold", key="guarded-p", reqs=[lure])
    stranger.call("expect", key="stranger-d", producer=ref_p, reqs=[lure])
    outcome = stranger.call("wait", key="stranger-d", reqs=[lure])["lure"]
    assert outcome.error_type == "PeerAuthError" and TOLD[intruder] in outcome.message, outcome
    print(f"\n[auth] {intruder}: {outcome.error_type}: {outcome.message[:120]}")
    stats = producer.call("stats", key="guarded-p")
    if intruder != "no-auth":  # a client without CURVE fails ZMQ's greeting, before any count is kept
        assert stats["channel"]["auth_failures"] > 0, stats  # refused, and counted
    assert stats["peers"] == [] and stats["links"] == {} and stats["tensors_sent"] == 0, stats
    # The engines that hold the credentials are served as before, the lure included.
    _build(member, "member-d", "consumer", GOOD)
    member.call("expect", key="member-d", producer=ref_p, reqs=[lure])
    assert member.call("wait", key="member-d", reqs=[lure])["lure"].ok
    assert producer.call("stats", key="guarded-p")["peers"] == ["member-d.r0"]
