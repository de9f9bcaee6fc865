"""Conversion from the CRI's protobuf messages to the runtime's model (``model``).

The CRI client's listings parse only each item's ID and state (``LeanSandboxList``,
``LeanContainerList``) and convert in full only what is new or changed (``reuse_listed``); the
other builders turn one status message, or containerd's verbose info, into a frozen value.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.runtime.model import (
    Container,
    ContainerState,
    ContainerStatus,
    PodSandbox,
    SandboxState,
    SandboxStatus,
)


def id_and_state_listings() -> tuple[Any, Any]:
    """ListPodSandboxResponse and ListContainersResponse that parse only each item's ID and state.

    Relists need just those two to tell what is new or changed; parsing every label and
    annotation map of every object was most of a large listing's parse. The rest of each item is
    kept as unknown fields, so a new or changed item is parsed in full from its own bytes.
    """
    lean = descriptor_pb2.FileDescriptorProto(
        name="cri_prober/lean_listings.proto", package="cri_prober.lean", syntax="proto3"
    )
    field_type = descriptor_pb2.FieldDescriptorProto
    names = []
    for response, repeated in (
        (api_pb2.ListPodSandboxResponse, "items"),
        (api_pb2.ListContainersResponse, "containers"),
    ):
        items = response.DESCRIPTOR.fields_by_name[repeated]
        item = items.message_type
        assert item is not None  # a repeated message field
        lean_item = lean.message_type.add(name=item.name)
        # The field numbers come from the real messages; an enum is an int32 on the wire.
        for name, kind in (("id", field_type.TYPE_BYTES), ("state", field_type.TYPE_INT32)):
            lean_item.field.add(
                name=name,
                number=item.fields_by_name[name].number,
                type=kind,
                label=field_type.LABEL_OPTIONAL,
            )
        lean.message_type.add(name=response.DESCRIPTOR.name).field.add(
            name="items",
            number=items.number,
            type=field_type.TYPE_MESSAGE,
            label=field_type.LABEL_REPEATED,
            type_name=f".cri_prober.lean.{item.name}",
        )
        names.append(f"cri_prober.lean.{response.DESCRIPTOR.name}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(lean)
    sandboxes, containers = (
        message_factory.GetMessageClass(pool.FindMessageTypeByName(name)) for name in names
    )
    return sandboxes, containers


LeanSandboxList, LeanContainerList = id_and_state_listings()


def _keyed(mapping: Mapping[str, str], like: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """A copy of a label or annotation map whose keys are interned: the kubelet's keys
    (``io.kubernetes.pod.name``, ``io.kubernetes.container.hash``, ...) are the same on every
    container, and each conversion made new strings of them (issue 25: a node's memory, by what
    is kept). ``like``, the same object's map as its listing gave it, is the answer when equal:
    CRI fixes labels and annotations at creation, so a status shares its listing's maps instead
    of keeping a second copy of every value (four maps per container, a pod's annotations among
    them)."""
    keyed = {sys.intern(key): value for key, value in mapping.items()}
    return like if like is not None and like == keyed else keyed


def sandbox_from_pb(
    pb: api_pb2.PodSandbox | api_pb2.PodSandboxStatus,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    listed: PodSandbox | None = None,
) -> PodSandbox:
    return PodSandbox(
        id=pb.id,
        name=pb.metadata.name,
        namespace=pb.metadata.namespace,
        uid=pb.metadata.uid,
        attempt=pb.metadata.attempt,
        state=SandboxState(pb.state),
        created_at=pb.created_at,
        labels=_keyed(labels, None if listed is None else listed.labels),
        annotations=_keyed(annotations, None if listed is None else listed.annotations),
        runtime_handler=pb.runtime_handler,
    )


class _Listed(Protocol):
    """What ``reuse_listed`` compares of a listed object it already has."""

    @property
    def state(self) -> int: ...


_L = TypeVar("_L", bound=_Listed)


def reuse_listed(
    items: Sequence[Any], known: dict[bytes, _L], convert: Callable[[Any], _L]
) -> tuple[list[_L], dict[bytes, _L]]:
    """Convert a listing's ID-and-state items, reusing what ``known`` has with the same state.

    Only the state of a sandbox or container can change (CRI fixes its sandbox, metadata, image,
    labels and annotations when it is created), so an object already converted with this state
    is the answer; converting every object anew made a relist cost ~10 µs per object. Returns
    the objects and, by ID (in the returned order), what the next listing may reuse.
    """
    get = known.get
    listed = [
        current if (current := get(item.id)) is not None and current.state == item.state else None
        for item in items
    ]
    # IDs in a listing are unique, so nothing new and as many as known means nothing is gone:
    # then the answer is the last one, in its order (a runtime lists in no particular order,
    # containerd in a random one), so that a caller can tell it is unchanged by identity alone.
    if all(listed) and len(listed) == len(known):
        return list(known.values()), known
    seen: dict[bytes, _L] = {}
    for index, item in enumerate(items):
        current = listed[index]
        if current is None:
            current = listed[index] = convert(item)
        seen[item.id] = current
    return listed, seen  # type: ignore[return-value]  # every None was replaced


def sandbox_from_item(item: Any) -> PodSandbox:
    pb = api_pb2.PodSandbox.FromString(item.SerializeToString())
    return sandbox_from_pb(pb, pb.labels, pb.annotations)


def container_from_item(item: Any) -> Container:
    return container_from_pb(api_pb2.Container.FromString(item.SerializeToString()))


def sandbox_status_from_pb(
    pb: api_pb2.PodSandboxStatus, listed: PodSandbox | None = None
) -> SandboxStatus:
    """``listed``: the sandbox as a listing gave it, whose maps the status shares if equal."""
    return SandboxStatus(
        sandbox=sandbox_from_pb(pb, pb.labels, pb.annotations, listed),
        ip=pb.network.ip,
        additional_ips=tuple(ip.ip for ip in pb.network.additional_ips),
        host_network=pb.linux.namespaces.options.network == api_pb2.NODE,
    )


def container_from_pb(pb: api_pb2.Container) -> Container:
    return Container(
        id=pb.id,
        pod_sandbox_id=pb.pod_sandbox_id,
        name=pb.metadata.name,
        attempt=pb.metadata.attempt,
        image=pb.image.image,
        image_ref=pb.image_ref,
        state=ContainerState(pb.state),
        created_at=pb.created_at,
        labels=_keyed(pb.labels),
        annotations=_keyed(pb.annotations),
    )


def container_status_from_pb(
    pb: api_pb2.ContainerStatus,
    info: Mapping[str, str] | None = None,
    listed: Container | None = None,
) -> ContainerStatus:
    """``listed``: the container as a listing gave it, whose maps the status shares if equal."""
    env, pid = parse_verbose_info(info) if info else (None, None)
    return ContainerStatus(
        id=pb.id,
        name=pb.metadata.name,
        attempt=pb.metadata.attempt,
        state=ContainerState(pb.state),
        created_at=pb.created_at,
        started_at=pb.started_at,
        finished_at=pb.finished_at,
        exit_code=pb.exit_code,
        image=pb.image.image,
        image_ref=pb.image_ref,
        reason=pb.reason,
        message=pb.message,
        labels=_keyed(pb.labels, None if listed is None else listed.labels),
        annotations=_keyed(pb.annotations, None if listed is None else listed.annotations),
        env=env,
        pid=pid,
    )


def parse_verbose_info(info: Mapping[str, str]) -> tuple[dict[str, str] | None, int | None]:
    """Pull the configured env and the init PID out of containerd's verbose ``info`` JSON.

    The value is runtime-specific JSON; anything unexpected yields None rather than an error,
    because the caller can still probe without it.
    """
    try:
        data = json.loads(info.get("info", ""))
    except ValueError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    pid = data.get("pid") if isinstance(data.get("pid"), int) else None
    config = data.get("config")
    envs = config.get("envs") if isinstance(config, dict) else None
    if not isinstance(envs, list):
        return None, pid
    env: dict[str, str] = {}
    for item in envs:
        if isinstance(item, dict) and isinstance(item.get("key"), str):
            value = item.get("value", "")
            env[item["key"]] = value if isinstance(value, str) else ""
    return env, pid
