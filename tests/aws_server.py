"""A moto server on loopback standing in for EC2 and SSM, with what moto lacks for our tests.

:class:`Ec2Stand` runs moto's own WSGI app (``ThreadedMotoServer``) behind a small middleware
that

- records every request (action and parameters, from any process: the kernel's calls too);
- answers the placement-group actions, which moto 5.2 does not implement (an in-memory store
  with EC2's XML shapes and tag filters);
- injects EC2 errors on request (``fail``), as EC2 returns them, to test capacity, quota and
  failures midway.

It also publishes AWS's public SSM parameter of the Deep Learning AMI, which moto does not have
(only the Amazon Linux ones), pointing at an image moto knows.
"""

from __future__ import annotations

import datetime
import io
import json
import secrets
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server

ACCOUNT = "123456789012"
_XMLNS = "http://ec2.amazonaws.com/doc/2016-11-15/"


@dataclass
class Call:
    action: str
    params: dict[str, str]

    def tags(self, resource: str) -> dict[str, str]:
        """The tags of ``resource`` in this call's TagSpecification list."""
        out: dict[str, str] = {}
        for i in range(1, 10):
            if self.params.get(f"TagSpecification.{i}.ResourceType") != resource:
                continue
            for j in range(1, 50):
                key = self.params.get(f"TagSpecification.{i}.Tag.{j}.Key")
                if key is None:
                    break
                out[key] = self.params[f"TagSpecification.{i}.Tag.{j}.Value"]
        return out


@dataclass
class Fault:
    action: str
    code: str
    status: int
    when: Callable[[dict[str, str]], bool]
    times: int | None
    hits: int = 0


@dataclass
class _Group:
    name: str
    group_id: str
    strategy: str
    tags: dict[str, str] = field(default_factory=dict)


class _Middleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.calls: list[Call] = []
        self.faults: list[Fault] = []
        self.groups: dict[str, _Group] = {}

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        environ["wsgi.input"] = io.BytesIO(body)
        target = environ.get("HTTP_X_AMZ_TARGET", "")
        if target:  # the JSON protocol (SSM)
            action = target.rsplit(".", 1)[-1]
            params = {k: json.dumps(v) for k, v in json.loads(body or b"{}").items()}
        else:
            params = dict(urllib.parse.parse_qsl(body.decode()))
            action = params.get("Action", "")
        with self.lock:
            self.calls.append(Call(action, params))
            fault = next((f for f in self.faults if f.action == action and f.when(params)), None)
            if fault is not None:
                fault.hits += 1
                if fault.times is not None and fault.hits >= fault.times:
                    self.faults.remove(fault)
        if fault is not None:
            return self._error(start_response, fault.code, "injected by the test", fault.status)
        if action in ("CreatePlacementGroup", "DescribePlacementGroups", "DeletePlacementGroup"):
            with self.lock:
                return getattr(self, f"_{action}")(params, start_response)
        return self.app(environ, start_response)

    # ------------------------------------------------------------------ EC2 placement groups

    @staticmethod
    def _reply(start_response: Any, xml: str, status: str = "200 OK") -> list[bytes]:
        data = xml.encode()
        start_response(status, [("Content-Type", "text/xml"), ("Content-Length", str(len(data)))])
        return [data]

    def _error(self, start_response: Any, code: str, message: str, status: int) -> list[bytes]:
        xml = (
            f"<?xml version='1.0' encoding='UTF-8'?><Response><Errors><Error><Code>{code}</Code>"
            f"<Message>{escape(message)}</Message></Error></Errors>"
            f"<RequestID>{secrets.token_hex(8)}</RequestID></Response>"
        )
        reason = "Internal Server Error" if status >= 500 else "Bad Request"
        return self._reply(start_response, xml, f"{status} {reason}")

    @staticmethod
    def _item(g: _Group) -> str:
        tags = "".join(
            f"<item><key>{escape(k)}</key><value>{escape(v)}</value></item>"
            for k, v in g.tags.items()
        )
        return (
            f"<item><groupName>{escape(g.name)}</groupName><groupId>{g.group_id}</groupId>"
            f"<strategy>{g.strategy}</strategy><state>available</state>"
            f"<tagSet>{tags}</tagSet></item>"
        )

    def _CreatePlacementGroup(self, params: dict[str, str], start_response: Any) -> Any:
        name = params["GroupName"]
        if name in self.groups:
            return self._error(
                start_response, "InvalidPlacementGroup.Duplicate", f"{name} exists", 400
            )
        group = _Group(name, f"pg-{secrets.token_hex(8)}", params.get("Strategy", "cluster"))
        group.tags = Call("", params).tags("placement-group")
        self.groups[name] = group
        item = self._item(group).replace("<item>", "<placementGroup>", 1)
        item = item[: -len("</item>")] + "</placementGroup>"
        return self._reply(
            start_response,
            f'<CreatePlacementGroupResponse xmlns="{_XMLNS}"><requestId>1</requestId>'
            f"{item}</CreatePlacementGroupResponse>",
        )

    def _DescribePlacementGroups(self, params: dict[str, str], start_response: Any) -> Any:
        found = list(self.groups.values())
        names = [v for k, v in params.items() if k.startswith("GroupName.")]
        if names:
            found = [g for g in found if g.name in names]
        for i in range(1, 10):
            name = params.get(f"Filter.{i}.Name")
            if name is None:
                break
            values = [v for k, v in params.items() if k.startswith(f"Filter.{i}.Value.")]
            if name.startswith("tag:"):
                found = [g for g in found if g.tags.get(name[4:]) in values]
        items = "".join(self._item(g) for g in found)
        return self._reply(
            start_response,
            f'<DescribePlacementGroupsResponse xmlns="{_XMLNS}"><requestId>1</requestId>'
            f"<placementGroupSet>{items}</placementGroupSet></DescribePlacementGroupsResponse>",
        )

    def _DeletePlacementGroup(self, params: dict[str, str], start_response: Any) -> Any:
        name = params.get("GroupName", "")
        if self.groups.pop(name, None) is None:
            return self._error(
                start_response, "InvalidPlacementGroup.Unknown", f"{name} is unknown", 400
            )
        return self._reply(
            start_response,
            f'<DeletePlacementGroupResponse xmlns="{_XMLNS}"><requestId>1</requestId>'
            "<return>true</return></DeletePlacementGroupResponse>",
        )


class Ec2Stand(ThreadedMotoServer):
    """moto on 127.0.0.1 (a port the system gives it, read back once bound: a port picked free
    and bound later could be taken meanwhile) behind the middleware; see the module's docstring.
    """

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.middleware = _Middleware(DomainDispatcherApplication(create_backend_app))
        self.url = ""

    def _server_entry(self) -> None:
        self._server = make_server(
            self._ip_address,
            self._port,
            self.middleware,
            True,
            request_handler=MotoRequestHandler,
        )
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._server_ready_event.set()
        self._server.serve_forever()

    # ------------------------------------------------------------------------ test helpers

    @property
    def calls(self) -> list[Call]:
        with self.middleware.lock:
            return list(self.middleware.calls)

    def calls_of(self, action: str, since: int = 0) -> list[Call]:
        return [c for c in self.calls[since:] if c.action == action]

    @property
    def placement_groups(self) -> dict[str, _Group]:
        with self.middleware.lock:
            return dict(self.middleware.groups)

    def fail(
        self,
        action: str,
        code: str,
        *,
        status: int = 400,
        when: Callable[[dict[str, str]], bool] = lambda params: True,
        times: int | None = None,
    ) -> Fault:
        fault = Fault(action, code, status, when, times)
        with self.middleware.lock:
            self.middleware.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.middleware.lock:
            self.middleware.faults.clear()

    def publish_parameter(self, region: str, name: str, value: str) -> None:
        """Put a public (``/aws/service/...``) parameter into moto's SSM, as AWS publishes it."""
        from moto.ssm.models import Parameter, ssm_backends

        backend = ssm_backends[ACCOUNT][region]
        backend._parameters[name].append(  # the store behind get_parameter
            Parameter(
                account_id=ACCOUNT,
                name=name,
                value=value,
                parameter_type="String",
                description=None,
                allowed_pattern=None,
                keyid=None,
                last_modified_date=datetime.datetime.now(datetime.timezone.utc),
                version=1,
                data_type="aws:ec2:image",
            )
        )


def running() -> Iterator[Ec2Stand]:
    """Start a stand, yield it, stop it (a fixture's body)."""
    stand = Ec2Stand()
    stand.start()
    try:
        yield stand
    finally:
        stand.stop()


class NamespaceResolver:
    """Maps moto's instances (whose 10.x/54.x addresses have nothing behind them) onto SSH hosts
    in network namespaces (``tests/hosts.py``), node i onto host i.

    It also does at "boot" what cloud-init does on a real instance with the pool's key pair:
    the key pair's public key, read back from EC2, goes into the hosts' ``authorized_keys``. The
    host key each host must present is the namespace sshd's own (from the hosts' known_hosts),
    so the provider's connection still verifies host keys strictly.
    """

    def __init__(
        self,
        endpoint_url: str,
        hosts: Sequence[tuple[str, int]],
        known_hosts: str,
        authorized_keys: str,
        user: str = "root",
        region: str = "us-east-1",
    ) -> None:
        self.endpoint_url = endpoint_url
        self.hosts = list(hosts)
        self.authorized_keys = Path(authorized_keys)
        self.user = user
        self.region = region
        self.host_keys = {}
        for line in Path(known_hosts).read_text().splitlines():
            name, kind, key = line.split()[:3]
            self.host_keys[name] = f"{kind} {key}"

    def __call__(self, instance: Any, pool_host_key: str) -> Any:
        import boto3

        from skyward_jupyter.providers.aws import Reachable
        from skyward_jupyter.providers.ssh import Host

        ec2 = boto3.client(
            "ec2",
            region_name=self.region,
            endpoint_url=self.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        described = ec2.describe_instances(InstanceIds=[instance.instance_id])
        key_name = described["Reservations"][0]["Instances"][0]["KeyName"]
        pairs = ec2.describe_key_pairs(KeyNames=[key_name], IncludePublicKey=True)["KeyPairs"]
        public = pairs[0]["PublicKey"].strip()
        if public not in self.authorized_keys.read_text():
            with open(self.authorized_keys, "a") as f:
                f.write(public + "\n")
        address, port = self.hosts[instance.index]
        name = address if port == 22 else f"[{address}]:{port}"
        return Reachable(Host(address, self.user, port), self.host_keys[name], address)
