"""README.md's quick start and the docs' examples, run against a real broker, so the docs cannot drift from it.

The snippets are read from the documents themselves: a changed example is tested as it now reads."""

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from shardbroker.cluster import config as cfgmod

from support.harness import REPO, Broker, Raw

README = (REPO / "README.md").read_text()


def doc(name: str) -> str:
    return (REPO / "docs" / name).read_text()


def blocks(text: str, lang: str = "") -> list[str]:
    """The fenced code blocks of ``text`` (with that language tag, if given)."""
    found = re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    return [m.group(2) for m in found if not lang or m.group(1) == lang]


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:end if end >= 0 else None]


def brokerctl(*args, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    return subprocess.run([sys.executable, "-m", "shardbroker.cli", *args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, timeout=60, env={**base, **(env or {})})


def secure_example() -> dict:
    """configuration.md's "Jolt's secure example", bound to loopback, cheap to hash."""
    text = next(b for b in blocks(doc("configuration.md"), "json") if '"enabled": true' in b)
    config = json.loads(text)
    config["network"]["bind"] = "127.0.0.1"  # the tests never listen beyond loopback
    config["security"]["iterations"] = 1000
    return config


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    b = Broker(tmp_path_factory.mktemp("plain"), workers=2).start()
    yield b
    b.close()


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    b = Broker(tmp_path_factory.mktemp("secure"), workers=2, config=secure_example()).start()
    yield b
    b.close()


# -- transcripts: the lines a client sends, and what it reads back ------------------------------------------------

def run_transcripts(port: int, transcripts: list[list[str]]) -> None:
    """Run the clients' transcripts side by side: each sends its requests (lines with "op") and reads the other
    lines back verbatim; a client whose next line has not come yet waits while the others go on."""
    clients = [Raw(port) for _ in transcripts]
    steps = [list(t) for t in transcripts]
    try:
        deadline = time.monotonic() + 10
        while any(steps):
            progressed = False
            for c, todo in zip(clients, steps):
                while todo:
                    line = todo[0]
                    if '"op"' in line:
                        c.send(line.encode() + b"\n")
                    elif c.nothing(0.2):
                        break   # not yet: let the others go on
                    else:
                        assert c.line() == line.encode() + b"\n", line
                    todo.pop(0)
                    progressed = True
            assert progressed or time.monotonic() < deadline, f"stuck at {steps}"
    finally:
        for c in clients:
            c.close()


def test_readme_netcat_transcripts(plain):
    sessions = [b for b in blocks(README) if b.startswith("$ nc 127.0.0.1 8080\n")]
    assert len(sessions) == 2
    run_transcripts(plain.port, [s.splitlines()[1:] for s in sessions])


def test_readme_secure_transcript_with_the_documented_secure_example(secure):
    (session,) = [b for b in blocks(README) if b.startswith('{"op":"auth"')]
    run_transcripts(secure.port, [session.splitlines()])


def test_queues_md_attempts_transcript(plain):
    """docs/queues.md#attempts: the transcript as written, on a queue of its own; what the broker makes up (message
    ids, receipts, push times) is read as the document's, in the order they first come."""
    text = doc("queues.md")
    (block,) = [b for b in blocks(section(text, "### Attempts:")) if '"attempt":' in b]
    queue = "docs.attempts"
    lines = [line.replace('"queue":"jobs"', f'"queue":"{queue}"') for line in block.splitlines()]
    made_up: dict[str, str] = {}
    with Raw(plain.port) as c:
        for request, shown in zip(lines[::2], lines[1::2]):
            c.send(request.encode() + b"\n")
            got = c.line().decode().rstrip("\n")
            doc_reply, real = json.loads(shown), json.loads(got)
            pairs = list(zip(doc_reply.get("ids", []), real.get("ids", [])))
            for d, r in zip(doc_reply.get("messages", []), real.get("messages", [])):
                pairs += [(d["id"], r["id"]), (d["receipt"], r["receipt"])]
                got = got.replace(f'"enqueued_at":{r["enqueued_at"]}', f'"enqueued_at":{d["enqueued_at"]}', 1)
            for d, r in pairs:   # one real value for each the document shows: a replay's receipts are the first's
                assert made_up.setdefault(r, d) == d and list(made_up.values()).count(d) == 1, (request, d)
            for r, d in made_up.items():
                got = got.replace(r, d)
            assert got == shown, request


def test_readme_configuration_is_the_defaults():
    (text,) = [b for b in blocks(README, "json") if '"network"' in b]
    shown = json.loads(text)
    defaults = cfgmod.load(None)
    for section_name, keys in shown.items():
        for key, value in keys.items():
            if section_name == "security" and key == "admin_user":
                continue   # Jolt's empty admin_user ("password": ""): no administrator, as the default
            assert getattr(getattr(defaults, section_name), key) == value, f"{section_name}.{key}"


def test_readme_python_snippets(plain):
    """README's NATS and Python-client blocks, as written (its ports swapped for the test broker's): the delivery
    its comment shows arrives, and a NATS publish reaches an NDJSON subscriber as its comment says."""
    nats_code, client_code = blocks(README, "python")
    nats_code = nats_code.replace("4222", str(plain.ports["nats"]))
    client_code = client_code.replace("8080", str(plain.port))
    shown = re.search(r"# (Delivery\(.*\))", client_code).group(1)

    async def run() -> None:
        from shardbroker.cli.client import AsyncClient, Delivery

        seen = []

        async def handler(msg) -> None:
            seen.append((msg.subject, msg.data))

        async with await AsyncClient.connect("127.0.0.1", plain.port) as ndjson:
            await ndjson.sub("chat.room1")
            scope = {"handler": handler}
            exec(compile("async def nats_block():\n" + _indent(nats_code) + "    await nc.drain()\n",
                         "README.md", "exec"), scope)
            await scope["nats_block"]()
            assert seen == [("chat.room1", b"hello")]
            assert (await ndjson.next_message(timeout=5)).data == "hello"   # "NDJSON subscribers ... get hello too"
        scope = {}
        exec(compile("async def client_block():\n" + _indent(client_code) + "    return msg\n", "README.md", "exec"),
             scope)
        assert await scope["client_block"]() == eval(shown, {"Delivery": Delivery})

    asyncio.run(run())


def _indent(code: str) -> str:
    return "".join("    " + line + "\n" for line in code.splitlines())


# -- brokerctl as README.md and docs/security.md show it --------------------------------------------------------

def command_lines(block: str) -> list[list[str]]:
    """The brokerctl command lines of a shell block, comments dropped."""
    out = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["brokerctl"]:
            out.append(words[1:])
    return out


def test_readme_brokerctl_lines(plain):
    (block,) = [b for b in blocks(README, "sh") if "brokerctl pub" in b]
    lines = command_lines(block)
    env = {"BROKER_URL": f"127.0.0.1:{plain.port}"}
    (sub_args,) = [a for a in lines if a[0] == "sub"]
    pubs = [a for a in lines if a[0] == "pub"]
    sub = subprocess.Popen([sys.executable, "-m", "shardbroker.cli", *sub_args, "-n", str(len(pubs))], cwd=REPO, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env={**{k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}, **env})
    try:
        deadline = time.monotonic() + 10
        while plain.varz()["subscriptions"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for args in pubs:
            assert brokerctl(*args, env=env).returncode == 0, args
        out, err = sub.communicate(timeout=10)
    finally:
        sub.kill()
    assert [json.loads(line) for line in out.splitlines()] == [
        {"topic": "chat.room1", "data": "hello"}, {"topic": "chat.room1", "data": {"n": 1}}], err
    (hash_args,) = [a for a in lines if a[0] == "hash-password"]
    assert brokerctl(*hash_args, "--iterations", "1000", stdin="pw\n").stdout.startswith("$pbkdf2-sha256$i=1000$")
    assert ["--version"] in lines and brokerctl("--version").returncode == 0


def test_readme_free_port_start_runs_beside_another(tmp_path):
    """README's way to start a second broker: every listener on a free port, so two start side by side."""
    (block,) = [b for b in blocks(README, "sh") if b.startswith("brokerctl start --port 0")]
    (args,) = command_lines(block)

    class AsReadmeSays(Broker):
        def command(self):
            return [sys.executable, "-m", "shardbroker.cli", *args, "--workers", "1"]

    first = AsReadmeSays(tmp_path / "a", workers=1)
    second = AsReadmeSays(tmp_path / "b", workers=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        first.start()
        second.start()
        assert set(first.ports) == set(second.ports) == {"ndjson", "nats", "monitoring"}
        assert not set(first.ports.values()) & set(second.ports.values())
    finally:
        for b in (first, second):
            b.close()


def test_security_md_brokerctl_block(secure):
    (block,) = [b for b in blocks(section(doc("security.md"), "## brokerctl"), "sh")]
    env = {"BROKER_URL": f"127.0.0.1:{secure.port}", "BROKER_ADMIN_USER": "admin",
           "BROKER_ADMIN_PASSWORD": "strong-admin-password"}
    for args in command_lines(block):
        if args[0] != "user":
            continue   # `sub` runs until Ctrl-C; README's lines test it
        res = brokerctl(*args, stdin="carol-pw\n", env=env)
        assert res.returncode == 0, (args, res.stderr)
        assert len(res.stdout.splitlines()) >= 1, args


def test_brokerctl_md_user_table_is_what_brokerctl_prints(secure):
    env = {"BROKER_URL": f"127.0.0.1:{secure.port}", "BROKER_ADMIN_USER": "admin",
           "BROKER_ADMIN_PASSWORD": "strong-admin-password"}
    table = section(doc("brokerctl.md"), "## user")
    rows = re.findall(r"^\| `brokerctl (user [^`]+)`(?: \(again\))? \| `([^`]+)`", table, re.M)
    assert len(rows) >= 6
    for command, printed in rows:
        res = brokerctl(*shlex.split(command), stdin="dave-pw\n", env=env)
        assert res.returncode == 0, (command, res.stderr)
        assert res.stdout == printed + "\n", command


def test_brokerctl_md_names_every_option():
    import click

    from shardbroker.cli.main import cli

    text = doc("brokerctl.md")
    missing = []

    def walk(cmd, path):
        for p in cmd.params:
            if isinstance(p, click.Option):
                missing.extend(f"{path} {o}" for o in p.opts if not re.search(rf"`(brokerctl )?{o}\b", text))
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                if path == "brokerctl" and name not in ("start", "pub", "sub", "hash-password", "user", "queue"):
                    continue   # bench and loadtest: docs/performance.md and docs/loadtest.md
                walk(sub, f"{path} {name}")

    walk(cli, "brokerctl")
    assert not missing, f"options missing from docs/brokerctl.md: {missing}"


# -- what docs/operations.md and docs/protocol.md show ----------------------------------------------------------

def ready_keys(line: str) -> list[str]:
    return re.findall(r"(\w+)=", line[line.index("ready: "):])


def test_ready_line_examples_are_the_real_one(plain):
    real = re.search(r"ready: .*", plain.log()).group(0)
    examples = [line for text in (README, doc("operations.md")) for b in blocks(text) for line in b.splitlines()
                if "ready: " in line]
    assert len(examples) == 2
    for example in examples:
        assert ready_keys(example) == ready_keys(real) == ["ndjson", "nats", "monitoring", "workers", "pids",
                                                           "version", "hot_path"], example


def fields(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", text))


def test_monitoring_fields_are_documented(plain):
    ops = doc("operations.md")
    documented = fields(section(ops, "## Monitoring"))
    varz = plain.varz()
    worker = varz["workers"][0]
    link = next(iter(worker["fabric"]["links"].values()))
    with Raw(plain.port):
        time.sleep(0.2)
        conn = plain.http("/connz")[1]["connections"][0]
    missing = {f"varz.{k}" for k in varz if k not in documented} | \
        {f"varz.workers[].{k}" for k in worker if k not in documented} | \
        {f"varz.workers[].fabric.{k}" for k in worker["fabric"] if k not in documented} | \
        {f"fabric link: {k}" for k in link if k not in documented} | \
        {f"connz: {k}" for k in conn if k not in documented}
    assert not missing, f"undocumented in operations.md: {sorted(missing)}"
    assert conn["protocol"] == conn["type"] == "ndjson"
    assert sorted(varz["ports"]) == ["nats", "ndjson"] and varz["http_port"] == plain.ports["monitoring"]
    status, body = plain.http("/path")
    assert status == 404 and f"`{json.dumps(body, separators=(',', ':'))}`" in ops


def test_a_stuck_worker_makes_healthz_503_after_about_2s(start_broker):
    b = start_broker(workers=2)
    ops = doc("operations.md")
    os.kill(b.pids[1], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        status, body = b.http("/healthz")
        took = time.monotonic() - t0
    finally:
        os.kill(b.pids[1], signal.SIGCONT)
    assert status == 503 and f"`{json.dumps(body, separators=(',', ':'))}`" in ops
    assert 1.8 < took < 4, took


def test_protocol_md_info_reply(plain, secure):
    row = next(line for line in doc("protocol.md").splitlines() if line.startswith('| `{"op":"info"}`'))
    with Raw(plain.port) as c:
        info = c.request({"op": "info"})["info"]
    assert "user" not in info
    assert all(f"`{k}`" in row for k in info), info
    with Raw(secure.port) as c:
        assert c.request({"op": "auth", "user": "chatuser", "pass": "secret3"}) == {"ok": True}
        assert c.request({"op": "info"})["info"]["user"] == "chatuser"


def test_sighup_with_a_broken_file_keeps_the_users_as_operations_md_says(tmp_path):
    b = Broker(tmp_path, workers=1, config=secure_example()).start()
    try:
        path = next(tmp_path.glob("config-*.json"))
        row = next(line for line in doc("operations.md").splitlines() if line.startswith("| `SIGHUP` |"))
        said = re.search(r"the log says `([^`<]+)<key>: <reason>`", row).group(1)
        for broken, reason in (("{not json", "not valid JSON"),
                               (json.dumps({**secure_example(), "network": {"prot": 1}}), "network.prot: unknown key")):
            path.write_text(broken)
            mark = len(b.log())
            os.kill(b.proc.pid, signal.SIGHUP)
            line = b.wait_log(r"SIGHUP: configuration not reloaded.*", after=mark).group(0)
            assert line.startswith(said) and reason in line, line
            with Raw(b.port) as c:
                assert c.request({"op": "auth", "user": "chatuser", "pass": "secret3"}) == {"ok": True}
        assert b.proc.poll() is None
    finally:
        b.close()


def test_readme_layout_names_every_script_and_every_folder():
    """The layout section listed 4 of the 20 scripts and left out cli/loadtest and cli/top: it names each now,
    and this keeps it so as the tree moves."""
    layout = README[README.index("## Repository layout"):]
    scripts = sorted(str(p.relative_to(REPO / "scripts")) for p in (REPO / "scripts").rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)
    assert scripts, "no scripts found: the test would pass for nothing"
    folders = sorted(f"{p.parent.name}/{p.name}/" for top in ("cli", "workers", "cluster", "router")
                     for p in (REPO / top).iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    missing = [name for name in scripts if f"`{name}`" not in layout]
    missing += [f for f in folders if f"`{f.split('/', 1)[1]}`" not in layout and f"`{f}`" not in layout]
    assert not missing, f"not in README.md's layout: {missing}"
