"""Drives a live Ballast node through the Python client that
openapi-python-client generated from the node's own OpenAPI document
(tests/it/openapi.rs runs it): enqueues a batch, lists it with filters,
acts on a record, reads the audit log and a problem. Every call goes
through the generated code; an assertion that fails exits non-zero.

    python client_check.py BASE_URL OPERATOR_TOKEN
"""

import sys

from ballast_client import AuthenticatedClient
from ballast_client.api.audit import audit_log
from ballast_client.api.records import act_on_record, enqueue, get_record, list_records
from ballast_client.models import (
    ActBody,
    AuditPage,
    EnqueueBody,
    EnqueuedBatch,
    ListRecordsState,
    OperatorAction,
    Problem,
    RecordPage,
    RecordState,
)


def main(base: str, token: str) -> None:
    client = AuthenticatedClient(base_url=f"{base}/api/v1", token=token, raise_on_unexpected_status=True)

    # A batch, due in an hour: at rest long enough to be acted on.
    batch = [
        EnqueueBody(pipeline="leads", key=f"py-{n}", group="python", input_={"n": n}, delay="1h")
        for n in range(3)
    ]
    made = enqueue.sync_detailed(client=client, body=batch)
    assert made.status_code == 201, made
    assert isinstance(made.parsed, EnqueuedBatch), made.parsed
    assert made.parsed.created == 3, made.parsed
    ids = [item.record.id for item in made.parsed.items]
    assert all(item.record.state == RecordState.PENDING for item in made.parsed.items)
    assert [item.record.input_ for item in made.parsed.items] == [{"n": n} for n in range(3)]

    # The list's filters: the group and state select the batch, newest first.
    page = list_records.sync(client=client, group="python", state=ListRecordsState.PENDING, limit=2)
    assert isinstance(page, RecordPage), page
    assert [r.id for r in page.items] == sorted(ids, reverse=True)[:2], page
    assert page.next_ is not None
    rest = list_records.sync(client=client, group="python", state=ListRecordsState.PENDING, before=page.next_)
    assert [r.id for r in rest.items] == [min(ids)], rest
    assert list_records.sync(client=client, group="nobody").items == []

    # An action, by the dashboard's rules.
    parked = act_on_record.sync(
        client=client,
        id=ids[0],
        body=ActBody(action=OperatorAction.PARK, reason="checked by the Python client", until="never"),
    )
    assert parked.record.state == RecordState.PARKED, parked
    detail = get_record.sync(client=client, id=ids[0])
    assert OperatorAction.RESUME in detail.actions, detail.actions

    # The audit log names who did it and why.
    audit = audit_log.sync(client=client, kind="park")
    assert isinstance(audit, AuditPage), audit
    entry = next(e for e in audit.items if e.record_id == ids[0])
    assert entry.reason == "checked by the Python client", entry
    assert entry.actor.startswith("token:"), entry

    # A refusal is a problem with its stable code.
    client_lenient = AuthenticatedClient(base_url=f"{base}/api/v1", token=token)
    missing = get_record.sync_detailed(client=client_lenient, id=max(ids) + 1000)
    assert missing.status_code == 404, missing
    assert isinstance(missing.parsed, Problem), missing.parsed
    assert missing.parsed.code == "not_found", missing.parsed

    print(f"client check: {len(ids)} enqueued, listed in pages, one parked, audited, a 404 read")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
