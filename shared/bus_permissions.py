"""What each role may publish and subscribe to on NATS, as nats-server enforces it, and the
server's authorization config rendered from the identities.

Pure: a role and its scope in, subject lists out. Every subject is built from
shared/subjects.py, so a renamed subject cannot leave a permission behind. Anything not
allowed here is refused by nats-server itself (a permissions violation), whatever berth's
code does; docs/security.md walks through each role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from berth.shared import subjects
from berth.shared.credentials import Identity, Role

EVENTS = subjects.EVENTS_STREAM
SUBMIT = subjects.SUBMIT_STREAM
LOGS = subjects.LOGS_STREAM
BUNDLES = subjects.BUNDLES_STREAM
API = "$JS.API"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May answer requests it received (once each, to their reply subject): the scheduler's
    # acknowledgement of heartbeats, without a right to publish on any worker's inbox.
    allow_responses: bool = False


def _streams_setup() -> list[str]:
    """Creating and updating berth's own streams (never deleting or purging them): every
    control-plane service makes sure they exist at start."""
    out = [f"{API}.INFO"]
    for stream in (SUBMIT, EVENTS, LOGS, BUNDLES):
        out += [f"{API}.STREAM.INFO.{stream}", f"{API}.STREAM.CREATE.{stream}",
                f"{API}.STREAM.UPDATE.{stream}"]
    return out


def _readers(stream: str) -> list[str]:
    """Ephemeral (ordered) consumers on a stream, which is how the services follow it."""
    return [
        f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.CREATE.{stream}.>",
        f"{API}.CONSUMER.INFO.{stream}.*", f"{API}.CONSUMER.DELETE.{stream}.*",
        f"{API}.CONSUMER.MSG.NEXT.{stream}.*", f"{API}.STREAM.MSG.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}", f"{API}.DIRECT.GET.{stream}.>",
        # Flow-control answers of push consumers, and acks of durable ones.
        f"$JS.FC.{stream}.>", f"$JS.ACK.{stream}.>",
    ]


def _followers(stream: str) -> list[str]:
    """An ordered consumer on a stream and nothing more: no direct gets of its subjects."""
    return [f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.CREATE.{stream}.>",
            f"{API}.CONSUMER.INFO.{stream}.*", f"{API}.CONSUMER.DELETE.{stream}.*",
            f"$JS.FC.{stream}.>"]


def _bundle_lookup() -> list[str]:
    """Binding to the bundles bucket and reading one object's metadata (does it exist?)."""
    return [f"{API}.STREAM.INFO.{BUNDLES}", f"{API}.STREAM.MSG.GET.{BUNDLES}",
            f"{API}.DIRECT.GET.{BUNDLES}", f"{API}.DIRECT.GET.{BUNDLES}.>"]


def permissions(role: Role, scope: str, inbox: str) -> Permissions:
    """`scope` is the worker id (role worker) or the user name (role submit); `inbox` is the
    identity's reply prefix (subjects.inbox_prefix)."""
    replies = f"{inbox}.>"
    if role is Role.ADMIN:
        return Permissions(publish=(">",), subscribe=(">",))
    if role is Role.WORKER:
        return Permissions(
            publish=(subjects.attempt_reports(scope), subjects.worker_events(scope),
                     subjects.heartbeat(scope), subjects.worker_logs(scope),
                     # Fetching bundles: read-only (an ordered consumer on the bucket).
                     *_bundle_lookup(), *_readers(BUNDLES)),
            subscribe=(subjects.worker_commands(scope), subjects.LEADER, replies),
        )
    if role is Role.SUBMIT:
        return Permissions(
            publish=(subjects.submit_job(scope), subjects.submit_cancel(scope),
                     # Reading its own submits' outcomes, one message at a time.
                     f"{API}.DIRECT.GET.{EVENTS}.{subjects.submit_outcomes(scope)}",
                     # Uploading bundles: writing chunks and metadata, never deleting
                     # or purging the stream; a worker checks every bundle's digest.
                     *_bundle_lookup(), subjects.BUNDLE_CHUNKS, subjects.BUNDLE_META),
            subscribe=(replies,),
        )
    if role is Role.SCHEDULER:
        return Permissions(
            publish=(subjects.LEADER, subjects.worker_commands("*"),
                     subjects.task_events("*"), subjects.ASSIGNMENTS,
                     subjects.PENDING_REASONS,
                     # A schedule's fires, each checked against the last one there.
                     subjects.schedule_fire("*"), f"{API}.STREAM.MSG.GET.{SUBMIT}",
                     subjects.LEADER_EVENTS, subjects.worker_verdicts("*"),
                     # Compaction (docs/retention.md): the record, then the purges.
                     subjects.JOBS_COMPACTED, f"{API}.STREAM.PURGE.{EVENTS}",
                     *_streams_setup(), *_readers(EVENTS)),
            subscribe=(subjects.HEARTBEATS_ALL, subjects.ADMIN_COMPACT, replies),
            allow_responses=True,
        )
    if role is Role.SUBMITTER:
        durable = subjects.SUBMITTER_DURABLE
        return Permissions(
            publish=(subjects.SUBMIT_OUTCOMES_ALL, *_streams_setup(),
                     f"{API}.CONSUMER.INFO.{SUBMIT}.{durable}",
                     f"{API}.CONSUMER.CREATE.{SUBMIT}.{durable}",
                     f"{API}.CONSUMER.CREATE.{SUBMIT}.{durable}.>",
                     f"{API}.CONSUMER.DURABLE.CREATE.{SUBMIT}.{durable}",
                     f"{API}.CONSUMER.MSG.NEXT.{SUBMIT}.{durable}",
                     f"$JS.ACK.{SUBMIT}.{durable}.>",
                     f"{API}.STREAM.MSG.GET.{EVENTS}",
                     f"{API}.DIRECT.GET.{EVENTS}.{subjects.SUBMIT_OUTCOMES_ALL}",
                     # Whether a token a spec asks for exists (an admin set its limit).
                     f"{API}.DIRECT.GET.{EVENTS}.{subjects.ADMIN_TOKENS_ALL}",
                     # Its fold of the log, for `existing` and `dedup` (index.py).
                     *_followers(EVENTS)),
            subscribe=(replies,),
        )
    if role is Role.DASHBOARD:
        return Permissions(
            publish=(subjects.SUBMIT_JOB, subjects.submit_job("*"),
                     subjects.SUBMIT_CANCEL, subjects.submit_cancel("*"),
                     *_streams_setup(), *_readers(EVENTS), *_readers(LOGS),
                     f"{API}.CONSUMER.DURABLE.CREATE.{EVENTS}.*"),
            subscribe=(subjects.HEARTBEATS_ALL, replies),
        )
    raise ValueError(f"no permissions for role {role!r}")


def authorization_config(identities: list[Identity]) -> dict[str, Any]:
    """nats-server's `authorization` block: one nkey user per identity. A connection with
    no valid signature from one of these keys is refused."""
    users = []
    for identity in identities:
        perms = permissions(identity.role, identity.scope,
                            subjects.inbox_prefix(identity.name))
        rules: dict[str, Any] = {
            "publish": {"allow": list(perms.publish)},
            "subscribe": {"allow": list(perms.subscribe)},
        }
        if perms.allow_responses:
            rules["allow_responses"] = True
        users.append({"nkey": identity.public_key, "permissions": rules})
    return {"users": users}
