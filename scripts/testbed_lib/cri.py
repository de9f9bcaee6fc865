"""The few CRI calls the testbed makes (readiness, image check, pod teardown): unary gRPC calls
through grpcio on the containerd socket, with cri_prober's generated messages.

grpcio and cri_prober come with the project's virtualenv, which `install` runs before: they are
imported only if present, and require_grpc() turns their absence into a one-line error.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from .common import TestbedError

try:
    import grpc
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    from cri_prober._gen.runtime.v1 import api_pb2
except ImportError:  # the system python running `install`: every call goes through require_grpc()
    HAVE_GRPC = False
else:
    HAVE_GRPC = True

RUNTIME_SERVICE = "/runtime.v1.RuntimeService/"
IMAGE_SERVICE = "/runtime.v1.ImageService/"

_CHANNEL_OPTIONS = [
    # A private subchannel per call: a connection refused while containerd is starting must not
    # leave a shared subchannel in reconnect backoff for the next poll.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]


def require_grpc() -> None:
    """Raise TestbedError unless grpcio and cri_prober import (as in the project's virtualenv)."""
    if not HAVE_GRPC:
        raise TestbedError(
            f"grpcio or cri_prober is not installed for {sys.executable}: run testbed.py with the"
            " project's"
            " virtualenv (.venv/bin/python scripts/testbed.py ...)"
        )


def _unary(socket_path: Path, method: str, request: bytes, timeout: float) -> bytes:
    """One unary call with serialized messages in and out; failures raise grpc.RpcError."""
    with grpc.insecure_channel(f"unix://{socket_path}", options=_CHANNEL_OPTIONS) as channel:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method)
        return call(request, timeout=timeout)


def _describe(error: grpc.RpcError) -> str:
    if isinstance(error, grpc.Call):
        return f"{error.code().name}: {error.details()}"
    return str(error)


def runtime_version(socket_path: Path) -> str | None:
    """VersionResponse.runtime_version, or None while the CRI server is not ready."""
    require_grpc()
    try:
        response = _unary(socket_path, RUNTIME_SERVICE + "Version", b"", timeout=5)
    except grpc.RpcError:
        return None  # not serving yet, or the CRI plugin still initialising (UNAVAILABLE)
    return api_pb2.VersionResponse.FromString(response).runtime_version or None


@functools.cache
def _image_status_messages() -> tuple[Any, Any]:
    """ImageStatusRequest and ImageStatusResponse, built at run time from their field numbers.

    The project's CRI proto leaves ImageService out; the testbed needs only these two messages,
    and of the response only whether field 1 (image) is set. Built once: start polls with them.
    """
    proto = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="cri_prober_testbed/image_status.proto", package="testbed.v1", syntax="proto3"
    )
    spec = file.message_type.add(name="ImageSpec")
    spec.field.add(name="image", number=1, type=proto.TYPE_STRING, label=proto.LABEL_OPTIONAL)
    file.message_type.add(name="Image")  # its fields are not needed: presence is the answer
    for name, field_type in (("ImageStatusRequest", "ImageSpec"), ("ImageStatusResponse", "Image")):
        message = file.message_type.add(name=name)
        message.field.add(
            name="image",
            number=1,
            type=proto.TYPE_MESSAGE,
            label=proto.LABEL_OPTIONAL,
            type_name=f".testbed.v1.{field_type}",
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    request = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("testbed.v1.ImageStatusRequest")
    )
    response = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("testbed.v1.ImageStatusResponse")
    )
    return request, response


def image_present(socket_path: Path, image: str) -> bool:
    """ImageStatus: the CRI image cache learns of imported images asynchronously, via events."""
    require_grpc()
    request_type, response_type = _image_status_messages()
    request = request_type()
    request.image.image = image
    try:
        response = _unary(
            socket_path, IMAGE_SERVICE + "ImageStatus", request.SerializeToString(), timeout=10
        )
    except grpc.RpcError:
        return False
    return bool(response_type.FromString(response).HasField("image"))


def sandbox_ids(socket_path: Path) -> list[str]:
    """The IDs of every pod sandbox (ListPodSandbox); TestbedError if the call fails."""
    require_grpc()
    try:
        response = _unary(socket_path, RUNTIME_SERVICE + "ListPodSandbox", b"", timeout=10)
    except grpc.RpcError as error:
        raise TestbedError(f"ListPodSandbox failed ({_describe(error)})") from None
    return [item.id for item in api_pb2.ListPodSandboxResponse.FromString(response).items]


def sandbox_call(socket_path: Path, method: str, sandbox_id: str, *, timeout: float) -> bool:
    """StopPodSandbox or RemovePodSandbox (their requests alike); True if the call succeeded."""
    if method not in ("StopPodSandbox", "RemovePodSandbox"):
        raise ValueError(f"not a pod sandbox call: {method}")
    require_grpc()
    request_type = (
        api_pb2.StopPodSandboxRequest
        if method == "StopPodSandbox"
        else api_pb2.RemovePodSandboxRequest
    )
    encoded = request_type(pod_sandbox_id=sandbox_id).SerializeToString()
    try:
        _unary(socket_path, RUNTIME_SERVICE + method, encoded, timeout=timeout)
    except grpc.RpcError:
        return False
    return True
