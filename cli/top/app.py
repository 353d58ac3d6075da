"""The ``brokerctl top`` console, in textual (imported by ``top`` alone: it costs ~0.25 s to import).

One table, whose columns are the current view's (cli/top/views.py): workers, subjects, queues, connections, leaf
links to NATS hubs, and the subscribers of one subject (Enter on a subject; Esc goes back).  Each refresh runs in a
thread (the HTTP requests block) and fetches only what the open view shows.  Rows are keyed by what they show
(worker, subject, cid, a worker's leaf link), so the cursor stays on its row while the order changes underneath it.
"""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Input, Static

from shardbroker.cli.top import endpoint, formatting, model, views

HELP = """\
w 1  workers        t 2  subjects        u 3  queues        c 4  connections        l 5  leaf links
o O  sort by the next / previous column (or click a header)     r  reverse the order
Enter on a subject: its subscribers (Esc: back)                 /  filter rows (Esc: clear)
b  raw numbers      p  pause      + -  refresh faster / slower      q  quit"""

# Worker columns that a broker may not report (yet): shown only when some worker has a value.
OPTIONAL = {"pending_bytes", "cpu", "rss", "fds", "loop_lag", "loop_lag_max", "heartbeat_age", "restarts",
            "owned_subjects", "idle", "rtt"}
FILTERED = ("subject", "queue", "host", "name", "user", "protocol", "patterns", "state", "url", "hub",
            "last_error")


class TopApp(App):
    TITLE = "brokerctl top"
    CSS = """
    #header { height: 4; padding: 0 1; background: $boost; }
    #title { height: 1; padding: 0 1; background: $primary-background; color: $text; text-style: bold; }
    #table { height: 1fr; }
    #filter { dock: bottom; display: none; }
    #filter.shown { display: block; }
    #status { height: 1; padding: 0 1; color: $text-muted; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("w,1", "view('workers')", "Workers"),
        Binding("t,2", "view('subjects')", "Subjects"),
        Binding("u,3", "view('queues')", "Queues"),
        Binding("c,4", "view('connections')", "Conns"),
        Binding("l,5", "view('leafs')", "Leafs"),
        Binding("o", "sort(1)", "Sort"),
        Binding("O", "sort(-1)", "Sort back", show=False),
        Binding("r", "reverse", "Reverse"),
        Binding("escape", "back", "Back"),
        Binding("slash", "filter", "Filter"),
        Binding("b", "raw", "Raw", show=False),
        Binding("p", "pause", "Pause"),
        Binding("plus,equals_sign", "speed(0.5)", "Faster", show=False),
        Binding("minus", "speed(2)", "Slower", show=False),
        Binding("question_mark", "help", "Help"),
    ]

    def __init__(self, poller: model.Poller, view: str = "workers", sort: str | None = None,
                 first: model.Snapshot | None = None) -> None:
        super().__init__()
        self.poller = poller
        self.view = view
        self.sorts = {name: v.default_sort for name, v in views.VIEWS.items()}
        self.sorts["subscribers"] = views.SUBSCRIBERS.default_sort
        if sort:
            self.sorts[view] = sort
        self.reversed: dict[str, bool] = {}
        self.subject: str | None = None       # the drill-down, when open
        self.snap = first
        self.filter = ""
        self.raw = False
        self.paused = False
        self.error = ""
        self.polls = 0
        self._busy = False
        self._columns: tuple[str, ...] = ()
        self._shown = ""                      # the view the table holds now
        self._cursor: dict[str, str] = {}     # view -> key of the selected row
        self._timer: Any = None

    # -- layout ---------------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static(id="title")
        table: DataTable = DataTable(id="table", cursor_type="row", zebra_stripes=True)
        yield table
        yield Input(placeholder="filter: a substring of the subject, queue, host, name or user", id="filter")
        yield Static(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.poller.client.base
        self.query_one(DataTable).focus()
        self._timer = self.set_interval(self.poller.interval, self.refresh_data)
        if self.snap is not None and self.view != "workers" and self._rows(self.snap) is None:
            self.snap = None
        if self.snap is None:
            self.refresh_data()
        else:
            self.polls = 1
            self._render()

    # -- data -----------------------------------------------------------------------------------------------
    def refresh_data(self) -> None:
        if self.paused or self._busy:
            return
        self._busy = True
        want = () if self.subject is not None else (self.view,)
        self._fetch(want, self.sorts["connections"], self.subject)

    @work(thread=True, exclusive=True, group="poll")
    def _fetch(self, want: tuple, conn_sort: str, subject: str | None) -> None:
        try:
            snap = self.poller.poll(want, conn_sort=conn_sort, subject=subject)
        except (endpoint.Unreachable, endpoint.BadRequest) as exc:
            self.call_from_thread(self._failed, str(exc))
            return
        except Exception as exc:  # a broker of another version answering something unexpected
            self.call_from_thread(self._failed, f"{type(exc).__name__}: {exc}")
            return
        self.call_from_thread(self._arrived, snap, subject)

    def _arrived(self, snap: model.Snapshot, subject: str | None) -> None:
        self._busy = False
        self.polls += 1
        self.error = ""
        if subject != self.subject:   # the drill-down was closed (or another opened) while this was in flight
            snap = model.Snapshot(snap.t, snap.varz, snap.summary, snap.workers)
        self.snap = snap
        self._render()
        if self._rows(snap) is None:  # the view changed while this was in flight: fetch what it shows now
            self.refresh_data()

    def _failed(self, message: str) -> None:
        self._busy = False
        self.error = f"{time.strftime('%H:%M:%S')} {message}; retrying every {self.poller.interval:g}s"
        self._render_status()

    # -- drawing --------------------------------------------------------------------------------------------
    def _current(self) -> views.View:
        return views.SUBSCRIBERS if self.subject is not None else views.VIEWS[self.view]

    def _rows(self, snap: model.Snapshot) -> list[dict] | None:
        if self.subject is not None:
            return snap.subscribers
        return {"workers": snap.workers, "subjects": snap.subjects, "queues": snap.queues,
                "connections": snap.connections, "leafs": snap.leafs}[self.view]

    def _render(self) -> None:
        snap = self.snap
        if snap is None:
            return
        self.query_one("#header", Static).update(self._header(snap))
        view = self._current()
        rows = self._rows(snap)
        rows = [] if rows is None else rows
        sort = self.sorts[view.name]
        # Rows the broker sorted are shown in its order, unless the sort changed since they were fetched (until
        # the refresh that asks for the new one arrives, they are sorted here).
        if view.name != "connections" or snap.connections_sorted_by != "server" or self._reversed(view) \
                or snap.connections_sort != sort:
            rows = views.sort_rows(rows, view, sort, self._reversed(view))
        if self.filter:
            needle = self.filter.lower()
            rows = [r for r in rows if any(needle in str(r.get(k, "")).lower() for k in FILTERED)]
        if view is views.SUBJECTS:   # more are fetched than shown, to keep their rates going
            rows = rows[:self.poller.limit]
        columns = [c for c in view.columns if c.key not in OPTIONAL or any(r.get(c.key) is not None for r in rows)]
        self._fill(view, columns, rows, sort)
        self.query_one("#title", Static).update(self._title(view, snap, len(rows)))
        self._render_status()

    def _fill(self, view: views.View, columns: list[views.Column], rows: list[dict], sort: str) -> None:
        table = self.query_one(DataTable)
        keys = tuple(c.key for c in columns) + (view.name, sort, str(self._reversed(view)))
        if self._shown and table.row_count and table.cursor_row < table.row_count:
            self._cursor[self._shown] = str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
        self._shown = view.name
        scroll = table.scroll_y
        if keys != self._columns:
            table.clear(columns=True)
            arrow = "▲" if (sort in views.ASCENDING) != self._reversed(view) else "▼"
            for c in columns:
                label = f"{c.title}{arrow}" if c.key == sort else c.title
                table.add_column(Text(label, justify="left" if c.kind == "str" else "right"), key=c.key)
            self._columns = keys
            scroll = 0
        else:
            table.clear()
        for row in rows:
            cells = []
            for c in columns:
                text = formatting.human(row.get(c.key), c.kind, self.raw)
                style = self._style(c.key, row)
                cells.append(Text(text, style=style, justify="left" if c.kind == "str" else "right"))
            table.add_row(*cells, key=str(row.get(view.key)))
        selected = self._cursor.get(view.name)
        if selected is not None and table.row_count:
            try:
                index = table.get_row_index(selected)
            except Exception:  # the row is gone: stay at the same position
                index = min(table.cursor_row, table.row_count - 1)
            table.scroll_to(y=scroll, animate=False, immediate=True)
            table.move_cursor(row=index, animate=False)

    @staticmethod
    def _style(key: str, row: dict) -> str:
        if key == "state" and row.get("state") not in ("ready", "connected", None):
            return "bold red"
        if key == "last_error" and row.get(key):
            return "yellow"
        if key in ("slow_consumers", "fabric_lost") and row.get(key):
            return "bold yellow"
        if key == "slow" and row.get(key):
            return "bold red"
        return ""

    def _reversed(self, view: views.View) -> bool:
        return self.reversed.get(view.name, False)

    def _header(self, snap: model.Snapshot) -> Text:
        s = snap.summary
        h = lambda v, kind: formatting.human(v, kind, self.raw)  # noqa: E731
        maxc = f"/{s['max_connections']}" if s.get("max_connections") else ""
        cores = f" of {s['cores']} cores" if s.get("cores") else ""
        state_style = "bold green" if s["state"] == "ready" else "bold red"
        text = Text()
        text.append(s["version"] if s["version"].startswith("shardbroker") else f"shardbroker {s['version']}",
                    style="bold")
        if s["server_name"]:
            text.append(f"  {s['server_name']}")
        text.append(f"  up {s['uptime']}  ")
        text.append(s["state"], style=state_style)
        text.append(f"  workers {s['workers_ready']}/{s['workers_total']}  {self.poller.client.base}\n")
        text.append("In   ", style="bold")
        text.append(f"{h(s['msgs_in_rate'], 'rate')} msg/s  {h(s['bytes_in_rate'], 'byterate')}/s  "
                    f"total {h(s['in_msgs'], 'rate')} msgs {h(s['in_bytes'], 'bytes')}      ")
        text.append("Out  ", style="bold")
        text.append(f"{h(s['msgs_out_rate'], 'rate')} msg/s  {h(s['bytes_out_rate'], 'byterate')}/s  "
                    f"total {h(s['out_msgs'], 'rate')} msgs {h(s['out_bytes'], 'bytes')}\n")
        text.append(f"Connections {s['connections']}{maxc} (since start {s['total_connections']})  "
                    f"subscriptions {s['subscriptions']}  slow consumers {s['slow_consumers']} ")
        text.append(f"(+{s['slow_consumers_new']})", style="bold yellow" if s["slow_consumers_new"] else "")
        text.append("  fabric lost ")
        text.append(str(s["fabric_lost"]), style="bold red" if s["fabric_lost"] else "")
        text.append(f" stalls {s['fabric_stalls']}")
        if s.get("leafnode_links"):
            up, links = s.get("leafnodes", 0), s["leafnode_links"]
            text.append("  leaf links ")
            text.append(f"{up}/{links} up", style="" if up == links else "bold red")
        text.append("\n")
        text.append(f"CPU {s['cpu']:.1f}%{cores}  RSS {h(s['mem'], 'bytes')}")
        if s.get("pending_bytes") is not None:
            text.append(f"  pending {h(s['pending_bytes'], 'bytes')}")
        if s.get("config_load_time"):
            loaded = str(s["config_load_time"])
            text.append(f"  config loaded {loaded.split('.')[0].replace('T', ' ')}{' UTC' if 'Z' in loaded else ''}")
        return text

    def _title(self, view: views.View, snap: model.Snapshot, shown: int) -> Text:
        sort = self.sorts[view.name]
        order = " reversed" if self._reversed(view) else ""
        if self.subject is not None:
            d = snap.subject_detail or {}
            text = f"subscribers of {self.subject}: {shown}   ({d.get('msgs', 0)} msgs, owner {d.get('owner', '-')})"
        elif view.name == "connections":
            by = {"server": "on the broker", "client": "here"}.get(snap.connections_sorted_by, "")
            text = f"connections: {shown} of {snap.connections_total}   sorted {by}"
        else:
            text = f"{view.name}: {shown}"
        text += f"   sort {sort}{order}"
        if self.filter:
            text += f"   filter '{self.filter}'"
        return Text(text)

    def _render_status(self) -> None:
        status = self.query_one("#status", Static)
        if self.error:
            status.update(Text(self.error, style="bold red"))
        elif self.paused:
            status.update(Text("paused (p resumes)", style="bold yellow"))
        else:
            status.update(f"every {self.poller.interval:g}s   {self.poller.client.requests} requests   "
                          f"? help")

    # -- keys -----------------------------------------------------------------------------------------------
    def action_view(self, name: str) -> None:
        self.subject = None
        if name == self.view:
            return
        self.view = name
        self._render()       # the columns at once; the rows with the next refresh (started now)
        self.refresh_data()

    def action_sort(self, step: int) -> None:
        view = self._current()
        keys = view.sort_keys()
        current = self.sorts[view.name]
        self.sorts[view.name] = keys[(keys.index(current) + step) % len(keys)] if current in keys else keys[0]
        self.reversed[view.name] = False
        self._resorted(view)

    def action_reverse(self) -> None:
        view = self._current()
        self.reversed[view.name] = not self._reversed(view)
        self._resorted(view)

    def _resorted(self, view: views.View) -> None:
        self._render()
        if view.name == "connections":   # the broker sorts before its limit: ask again
            self.refresh_data()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        view = self._current()
        key = str(event.column_key.value)
        if self.sorts[view.name] == key:
            self.reversed[view.name] = not self._reversed(view)
        else:
            self.sorts[view.name], self.reversed[view.name] = key, False
        self._resorted(view)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if self.subject is None and self.view == "subjects" and event.row_key.value:
            self.drill(str(event.row_key.value))

    def drill(self, subject: str) -> None:
        """Open the subscribers of ``subject`` (Bridge's topic -> subscribers table)."""
        self.subject = subject
        self._render()
        self.refresh_data()

    def action_back(self) -> None:
        flt = self.query_one("#filter", Input)
        if flt.has_class("shown"):
            flt.value = ""
            flt.remove_class("shown")
            self.filter = ""
            self.query_one(DataTable).focus()
            self._render()
        elif self.subject is not None:
            self.subject = None
            self._render()
            self.refresh_data()

    def action_filter(self) -> None:
        flt = self.query_one("#filter", Input)
        flt.add_class("shown")
        flt.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter = event.value
        self._render()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one(DataTable).focus()

    def action_raw(self) -> None:
        self.raw = not self.raw
        self._render()

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._render_status()

    def action_speed(self, factor: float) -> None:
        self.poller.interval = min(60.0, max(0.25, self.poller.interval * factor))
        self._timer.stop()
        self._timer = self.set_interval(self.poller.interval, self.refresh_data)
        self._render_status()

    def action_help(self) -> None:
        self.notify(HELP, title="keys", timeout=15)
