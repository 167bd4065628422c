"""Every number a request carries is bounded in validation: its largest value on the wire answers
INVALID_ARGUMENT (or the call's own answer), never INTERNAL with a traceback (docs/api.md#errors).

The RPCs and their numeric fields are read from the service's descriptor, so a field added later
is probed too."""

from __future__ import annotations

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import call_rpc, completed, unhandled_failures

SERVICE = pb.DESCRIPTOR.services_by_name["AgentRunner"]
LARGEST = {
    FieldDescriptor.TYPE_DOUBLE: 1e300,
    FieldDescriptor.TYPE_FLOAT: 3e38,
    FieldDescriptor.TYPE_UINT64: 2**64 - 1,
    FieldDescriptor.TYPE_FIXED64: 2**64 - 1,
    FieldDescriptor.TYPE_INT64: 2**63 - 1,
    FieldDescriptor.TYPE_SINT64: 2**63 - 1,
    FieldDescriptor.TYPE_UINT32: 2**32 - 1,
    FieldDescriptor.TYPE_FIXED32: 2**32 - 1,
    FieldDescriptor.TYPE_INT32: 2**31 - 1,
    FieldDescriptor.TYPE_SINT32: 2**31 - 1,
}


def numeric_fields() -> list[tuple[str, str]]:
    return [
        (method.name, field.name)
        for method in SERVICE.methods
        for field in method.input_type.fields
        if field.type in LARGEST and not field.is_repeated
    ]


async def test_the_largest_value_of_every_numeric_request_field_is_refused_or_served_never_internal(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon()
    events = await client.chat(prompt="hi")
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    ids = {"session_id": events[0].session_id, "run_id": events[0].run_id, "project_id": "proj", "path": "a.txt",
           "prompt": "hi", "permission_id": "p1", "option_id": "allow", "data": b"x"}  # fmt: skip
    probed = numeric_fields()
    assert ("Chat", "max_cost_usd") in probed and ("ReadFile", "offset") in probed

    answers = {}
    async with daemon.channel() as channel:
        wrote = await call_rpc(channel, "WriteFile", pb.WriteFileChunk(project_id="proj", path="a.txt", data=b"x"))
        assert wrote is None
        for method_name, field_name in probed:
            method = SERVICE.methods_by_name[method_name]
            request = message_factory.GetMessageClass(method.input_type)()
            for field in method.input_type.fields:
                if field.name in ids and not field.is_repeated:
                    setattr(request, field.name, ids[field.name])
            field = method.input_type.fields_by_name[field_name]
            setattr(request, field_name, LARGEST[field.type])
            refused = await call_rpc(channel, method_name, request)
            answers[f"{method_name}.{field_name}"] = refused.code().name if refused else "OK"

    broken = {name: code for name, code in answers.items() if code in ("INTERNAL", "UNKNOWN")}
    assert not broken, answers
    assert answers["Chat.max_cost_usd"] == "INVALID_ARGUMENT"
    assert not unhandled_failures()
