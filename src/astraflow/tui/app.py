"""The Textual dashboard: overview curves, members, events and a sample browser, polled read-only.

Over 400 lines because it is one Textual App: its panes render from one snapshot and its actions
share one control client; the poller, series, sample browser and dialogs are in their own modules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from astraflow.state.views import Sample
from astraflow.tui.confirm import Confirm
from astraflow.tui.samples import Decode, load_decoder, segments, version_span
from astraflow.tui.series import Series, fmt_duration, mismatch_text, progress_bar
from astraflow.tui.source import Snapshot, Source

if TYPE_CHECKING:
    from astraflow.transport.control_client import ControlClient

CURVES: tuple[tuple[str, str], ...] = (
    ("reward", "reward_mean"),
    ("loss", "loss"),
    ("kl", ""),
    ("entropy", "entropy"),
    ("samples/s", "samples_per_s"),
)
"""(plot id, metric) of the overview's curves; the KL metric depends on the objective."""
SAY_S = 8.0
"""Seconds a control's outcome stays on the status line before a poll may clear it."""


class Dashboard(App[int]):
    """A live or post-hoc view of one run."""

    TITLE = "astraflow"
    CSS = """
    #progress { height: auto; padding: 0 1; }
    #status-line { height: 1; padding: 0 1; color: $warning; }
    #plots { grid-size: 3 2; height: 1fr; min-height: 20; }
    PlotextPlot { border: round $primary-darken-2; }
    #bottom { height: 12; }
    #queues, #counters { width: 1fr; }
    #sample-table { height: 12; }
    #sample-detail { height: 1fr; padding: 0 1; }
    #failed { height: 10; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        # priority: a focused table must not swallow them (the app has no text input)
        Binding("1", "tab('overview')", "Overview", priority=True),
        Binding("2", "tab('members')", "Members", priority=True),
        Binding("3", "tab('events')", "Events", priority=True),
        Binding("4", "tab('samples')", "Samples", priority=True),
        Binding("p", "next_policy", "Next policy", priority=True),
        Binding("r", "refresh_now", "Refresh", priority=True),
        Binding("a", "toggle_admission(False)", "Pause/resume policy", priority=True),
        Binding("A", "toggle_admission(True)", "Pause/resume run", priority=True),
        Binding("d", "drain", "Drain member", priority=True),
        Binding("S", "stop_run", "Stop run", priority=True),
        Binding("q", "quit", "Quit", priority=True),
    ]

    def __init__(self, source: Source, interval_s: float = 1.0, control: ControlClient | None = None) -> None:
        super().__init__()
        self.source = source
        self.control = control
        """Sends the control keys' requests (None: a finished run or no controller; the keys say so)."""
        self.control_log: list[str] = []
        """What each control request got back (newest last), also shown on the status line."""
        self.stop_sent = False
        self.said_at = float("-inf")
        """time.monotonic() of the last say(); polls leave the status line alone for SAY_S after it."""
        self.unreachable_since: float | None = None
        """time.time() of the first failed poll in a row (None: the last poll answered)."""
        self.interval_s = interval_s
        self.series: dict[str, Series] = {}
        self.evals: dict[str, dict[str, Any]] = {}
        """Policy -> its newest held-out eval row."""
        self.policy = ""
        self.snap = Snapshot()
        self.decoders: dict[str, Decode | None] = {}
        self.shown_samples: list[Sample] = []
        self.polls = 0
        self.history_loaded = False
        self.first_paint_s: float | None = None
        self.plots_ready = False
        self.tables_ready = False
        self.pending_events: list[dict[str, Any]] = []
        """Events polled before the events table was mounted."""
        self.first_frame_at: tuple[float, float] | None = None
        """(perf_counter, process_time) when the first frame with data was drawn."""
        self._t0 = time.perf_counter()

    # ----- layout -------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        """Header, four tabs, footer."""
        yield Header()
        yield Static("", id="status-line")
        with TabbedContent(initial="overview"):
            with TabPane("Overview [1]", id="overview"), Vertical():
                yield Static("waiting for the first poll", id="progress")
                with Grid(id="plots"):
                    # the plots are built after the first frame (textual-plotext is slow to import and draw)
                    yield Static("drawing curves ...", id="plots-wait")
                with Horizontal(id="bottom"):
                    yield DataTable(id="queues", cursor_type="none")
                    yield DataTable(id="counters", cursor_type="none")
            # the hidden tabs' contents are mounted after the first frame (_build_rest)
            with TabPane("Members [2]", id="members"):
                yield Vertical(id="members-body")
            with TabPane("Events [3]", id="events"):
                yield Vertical(id="events-body")
            with TabPane("Samples [4]", id="samples"):
                yield Vertical(id="samples-body")
        yield Footer()

    def on_mount(self) -> None:
        """Set up tables, take the first poll at once, then poll on a timer."""
        self.query_one("#queues", DataTable).add_columns("queue", "count")
        self.query_one("#counters", DataTable).add_columns("data counter", "value")
        self.apply(self.source.poll())
        self.first_paint_s = time.perf_counter() - self._t0
        self.call_after_refresh(self._first_frame)
        self.set_interval(self.interval_s, self.action_refresh_now)

    def _first_frame(self) -> None:
        """Stamp the first frame drawn with the first poll's data (what `bench dash` calls start-up)."""
        self.first_frame_at = (time.perf_counter(), time.process_time())
        self.call_later(self._build_rest)

    async def _build_rest(self) -> None:
        """Mount the hidden tabs' tables and the plots, draw them, then load the older history
        (parsing a long history holds the GIL for a while, so only once the screen is complete)."""
        from textual_plotext import PlotextPlot

        members: DataTable[Any] = DataTable(id="member-table", cursor_type="row")
        events: DataTable[Any] = DataTable(id="event-table", cursor_type="row")
        failed: DataTable[Any] = DataTable(id="failed", cursor_type="row")
        samples: DataTable[Any] = DataTable(id="sample-table", cursor_type="row")
        await self.query_one("#members-body", Vertical).mount(members)
        await self.query_one("#events-body", Vertical).mount_all([events, Static("failed tasks"), failed])
        detail = VerticalScroll(Static("select a sample", id="sample-detail"))
        await self.query_one("#samples-body", Vertical).mount_all([samples, detail])
        members.add_columns(
            "member", "role", "status", "host", "hardware", "policies", "loaded", "slots", "tasks done",
            "heartbeat age",
        )  # fmt: skip
        events.add_columns("time", "event", "detail")
        failed.add_columns("task", "prompt", "attempts", "error")
        samples.add_columns("id", "task", "prompt key", "reward", "advantage", "versions", "status", "step")
        self.tables_ready = True
        self.render_members()
        self.render_events(self.pending_events)
        self.pending_events = []

        grid = self.query_one("#plots", Grid)
        await self.query_one("#plots-wait", Static).remove()
        await grid.mount_all(
            [PlotextPlot(id=f"plot-{pid.replace('/', '')}") for pid, _ in CURVES]
            + [PlotextPlot(id="plot-staleness")]
        )
        self.plots_ready = True
        self.render_overview()
        self.run_worker(self._load_history, thread=True, group="history")

    # ----- polling ------------------------------------------------------------------------------

    def _load_history(self) -> None:
        rows = self.source.history()
        self.call_from_thread(self._add_history, rows)

    def _add_history(self, rows: list[dict[str, Any]]) -> None:
        self._add_rows(rows, prepend=True)
        self.history_loaded = True
        self.render_overview()

    def _poll_worker(self) -> None:
        snap = self.source.poll()
        self.call_from_thread(self.apply, snap)

    def action_refresh_now(self) -> None:
        """Poll again (in a thread: a slow read never freezes the screen)."""
        self.run_worker(self._poll_worker, thread=True, exclusive=True, group="poll")

    def _add_rows(self, rows: list[dict[str, Any]], prepend: bool = False) -> None:
        by_policy: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            if r.get("kind") == "eval":
                # held-out eval rows reuse a step number: kept apart from the step curves
                pol = str(r.get("policy", "?"))
                if int(r.get("version", 0)) >= int(self.evals.get(pol, {}).get("version", -1)):
                    self.evals[pol] = r
                continue
            if "kind" in r:
                continue  # a late row: metrics that followed a step (a weight delta's), not a step
            by_policy.setdefault(str(r.get("policy", "?")), []).append(r)
        for pol, rs in by_policy.items():
            self.series.setdefault(pol, Series()).add(rs, prepend=prepend)

    def apply(self, snap: Snapshot) -> None:
        """Take a poll's result and redraw."""
        if not self.is_running or not self.query("#status-line"):
            return  # a poll that finished while the app was closing
        self.polls += 1
        self._add_rows(snap.new_rows)
        curves_changed = bool(snap.new_rows) or self.polls == 1
        status = self.query_one("#status-line", Static)
        if snap.error:
            if self.unreachable_since is None:
                self.unreachable_since = snap.taken
            if self.source.kind == "controller":
                since = time.strftime("%H:%M:%S", time.localtime(self.unreachable_since))
                status.update(f"CONTROLLER UNREACHABLE since {since}: {snap.error}")
            else:
                status.update(f"{self.source.kind}: {snap.error}")
            self.render_overview()  # its first line says the numbers are the last ones seen
            return
        self.unreachable_since = None
        if time.monotonic() - self.said_at > SAY_S:  # a control's outcome stays readable a while
            status.update("")
        new_events = snap.new_events
        self.snap = snap
        if not self.policy and snap.policies:
            self.policy = snap.policies[0]["name"]
        self.title = f"astraflow · {snap.run_name or '?'}"
        self.sub_title = f"{self.source.kind} · policy {self.policy or '-'}"
        if self.source.kind == "controller":
            self.sub_title += " · loss/KL/entropy curves, Events and Samples need --run-dir"
        self.render_overview(curves=curves_changed)
        self.render_members()
        self.render_events(new_events)

    # ----- rendering ----------------------------------------------------------------------------

    def progress_text(self) -> Text:
        """One line per policy: step against the budget, version, ETA, newest numbers."""
        out = Text()
        if self.unreachable_since is not None:
            out.append(
                f"no answer for {time.time() - self.unreachable_since:.0f}s: the numbers below are the last seen\n",
                style="bold red",
            )
        paused = set(self.snap.paused)
        if "*" in paused:
            out.append("admission paused for the whole run (A resumes)\n", style="bold yellow")
        for p in self.snap.policies or [{"name": n, "step": 0, "version": 0} for n in self.series]:
            s = self.series.get(p["name"], Series())
            last = s.last()
            step = int(p.get("step", 0))
            # each policy's own budget (policy.steps, else run.steps); 0 for a frozen policy
            budget = int(p.get("budget", self.snap.steps))
            trainable = p.get("trainable", True)
            done = budget > 0 and step >= budget
            eta = "done" if done else fmt_duration(s.eta_s(budget))
            mark = ">" if p["name"] == self.policy else " "
            out.append(f"{mark} {p['name']:<10} ", style="bold" if mark == ">" else "")
            if not trainable:
                out.append(f"frozen (served at version {p.get('version', 0)})\n", style="dim")
                continue
            out.append(f"step {step}/{budget} {progress_bar(step, budget)} ")
            out.append(f"version {p.get('version', 0)}  ETA {eta}  ")
            if p["name"] in paused:
                out.append("PAUSED  ", style="bold yellow")
            for key, label, fmt in (
                ("reward_mean", "reward", ".3f"),
                ("samples_per_s", "samples/s", ".1f"),
                ("staleness_max", "staleness max", ".0f"),
            ):
                v = last.get(key)
                out.append(f"{label} {'-' if v is None else format(v, fmt)}  ")
            out.append(mismatch_text(last))
            ev = self.evals.get(p["name"])
            if ev is not None:
                scores = " ".join(f"{k[5:]} {v:.2f}" for k, v in sorted(ev.items()) if k.startswith("eval/"))
                out.append(f"eval v{ev.get('version', '?')} {scores}")
            out.append("\n")
        trained = [p for p in self.snap.policies if p.get("trainable", True)]
        if trained and all(p["step"] >= int(p.get("budget", self.snap.steps)) for p in trained):
            out.append("run finished: every policy reached its step budget", style="bold green")
        elif self.stop_sent:
            out.append("stopping: trainers finish their step and checkpoint", style="bold yellow")
        return out

    def render_overview(self, curves: bool = True) -> None:
        """Progress lines, the curves of the selected policy (when they changed), staleness, queues and
        data counters."""
        self.query_one("#progress", Static).update(self.progress_text())
        s = self.series.get(self.policy, Series())
        if self.plots_ready:
            self.render_plots(s, curves)
        self.render_tables(s)

    def render_plots(self, s: Series, curves: bool) -> None:
        """The selected policy's curves (when they changed) and its staleness histogram."""
        from textual_plotext import PlotextPlot

        for pid, key in CURVES if curves else ():
            metric = key or s.kl_key() or "kl"
            plot = self.query_one(f"#plot-{pid.replace('/', '')}", PlotextPlot)
            plot.plt.clear_data()
            plot.plt.title(f"{self.policy} {metric}")
            xs, ys = s.curve(metric)
            if xs:
                plot.plt.plot(xs, ys, marker="braille")
            plot.refresh()
        hist = self.snap.staleness.get(self.policy, {})
        plot = self.query_one("#plot-staleness", PlotextPlot)
        plot.plt.clear_data()
        plot.plt.title(f"{self.policy} staleness (recent consumed samples)")
        if hist:
            plot.plt.bar([str(k) for k in hist], list(hist.values()))
        plot.refresh()

    def render_tables(self, s: Series) -> None:
        """Queue depths and data counters of the selected policy."""
        queues = self.query_one("#queues", DataTable)
        queues.clear()
        for name, n in self.snap.tasks.items():
            queues.add_row(f"tasks {name}", str(n))
        for name, n in self.snap.buffers.get(self.policy, {}).items():
            queues.add_row(f"samples {name}", str(n))
        counters = self.query_one("#counters", DataTable)
        counters.clear()
        for name, value in sorted(s.data_counters().items()):
            counters.add_row(name, f"{value:g}")
        last = s.last()
        if "replayed" in last:
            counters.add_row("replayed (this step)", f"{float(last['replayed']):g}")

    def render_members(self) -> None:
        """The member table; members not alive are greyed."""
        if not self.tables_ready:
            return
        table = self.query_one("#member-table", DataTable)
        table.clear()
        for m in self.snap.members:
            style = "" if m["status"] == "alive" else "dim"
            loaded = ", ".join(f"{k}:v{v}" for k, v in m.get("loaded", {}).items()) or "-"
            done = m.get("tasks_done")
            cells = [
                m["id"], m["role"], m["status"], m.get("host") or "-", m.get("hardware") or "-",
                ",".join(m.get("policies", [])) or "all", loaded, str(m.get("slots", 0)),
                "-" if done is None else str(done), f"{m['age_s']:.1f}s" if m["status"] == "alive" else "-",
            ]  # fmt: skip
            table.add_row(*[Text(c, style=style) for c in cells], key=m["id"])

    def render_events(self, new_events: list[dict[str, Any]]) -> None:
        """Append new events (newest at the bottom) and list failed tasks with their error."""
        if not self.tables_ready:
            self.pending_events += new_events
            return
        table = self.query_one("#event-table", DataTable)
        for e in new_events:
            bad = e["kind"] in ("member_dead", "error", "task_failed", "run_failed", "sink_failed")
            style = "bold red" if bad else ""
            table.add_row(
                time.strftime("%H:%M:%S", time.localtime(e["time"])),
                Text(e["kind"], style=style),
                e["detail"] or "",
            )
        if new_events:
            table.move_cursor(row=table.row_count - 1)
        failed = self.query_one("#failed", DataTable)
        failed.clear()
        for f in self.snap.failed:
            failed.add_row(str(f["id"]), f["prompt_key"] or "", str(f["attempts"]), (f["error"] or "")[:200])

    # ----- samples ------------------------------------------------------------------------------

    def load_samples(self) -> None:
        """Read the selected policy's newest trajectories into the sample table."""
        if not self.tables_ready:
            return
        self.shown_samples = self.source.samples(self.policy) if self.policy else []
        table = self.query_one("#sample-table", DataTable)
        table.clear()
        for smp in self.shown_samples:
            table.add_row(
                str(smp.id), str(smp.task_id), smp.prompt_key, f"{smp.reward:.3f}", f"{smp.advantage:+.3f}",
                version_span(smp.versions), smp.status, "-" if smp.consumed_step is None else str(smp.consumed_step),
                key=str(smp.id),
            )  # fmt: skip
        table.focus()  # arrow keys walk the samples
        detail = self.query_one("#sample-detail", Static)
        if not self.shown_samples:
            why = "no trajectories yet" if self.source.kind == "run-dir" else "needs --run-dir"
            detail.update(f"samples: {why}")
        elif self.policy not in self.decoders:
            detail.update("loading the tokenizer ...")
            self.run_worker(self._load_decoder, thread=True, group="tokenizer")
        else:
            self.show_sample(0)

    def _load_decoder(self) -> None:
        pol = self.policy
        dec = load_decoder(self.source.model_dir(pol))
        self.call_from_thread(self._decoder_ready, pol, dec)

    def _decoder_ready(self, policy: str, dec: Decode | None) -> None:
        self.decoders[policy] = dec
        row = self.query_one("#sample-table", DataTable).cursor_row
        self.show_sample(max(0, row))

    def show_sample(self, index: int) -> None:
        """Render one trajectory: mask runs decoded, completion highlighted, with versions."""
        if not 0 <= index < len(self.shown_samples):
            return
        smp = self.shown_samples[index]
        dec = self.decoders.get(self.policy)
        text = Text()
        text.append(f"trajectory {smp.id}  task {smp.task_id}  prompt {smp.prompt_key}\n", style="bold")
        text.append(
            f"reward {smp.reward:.3f}  advantage {smp.advantage:+.3f}  tokens {len(smp.tokens)}  "
            f"trained tokens {sum(smp.loss_mask)}  versions {version_span(smp.versions)}  status {smp.status}\n"
        )
        if dec is None:
            text.append("(no tokenizer for this policy: token ids shown)\n", style="dim")
        for seg in segments(smp, dec):
            label = (
                f"[generated {version_span(seg.versions)}, mask 1] " if seg.trained else "[context, mask 0] "
            )
            text.append("\n" + label, style="bold green" if seg.trained else "bold cyan")
            text.append(seg.text, style="" if seg.trained else "dim")
        self.query_one("#sample-detail", Static).update(text)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """Follow the cursor in the sample table."""
        if event.data_table.id == "sample-table" and self.policy in self.decoders:
            self.show_sample(event.cursor_row)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        """Read samples when their tab opens (they are not polled)."""
        if event.pane.id == "samples":
            self.load_samples()

    # ----- actions ------------------------------------------------------------------------------

    def action_tab(self, tab: str) -> None:
        """Show a tab."""
        # a focused widget in the pane being left would pull the tabs back to its pane
        self.set_focus(None)
        self.query_one(TabbedContent).active = tab

    def action_next_policy(self) -> None:
        """Show the next policy's curves and samples."""
        names = [p["name"] for p in self.snap.policies] or list(self.series)
        if not names:
            return
        self.policy = names[(names.index(self.policy) + 1) % len(names)] if self.policy in names else names[0]
        self.sub_title = f"{self.source.kind} · policy {self.policy}"
        self.render_overview()
        if self.query_one(TabbedContent).active == "samples":
            self.load_samples()

    # ----- control keys ---------------------------------------------------------------------------

    def _no_control(self) -> bool:
        if self.control is None:
            self.say(
                "control keys are off: no live controller recorded, or no operator key (--key, --controller-key)"
            )
            return True
        return False

    def say(self, text: str) -> None:
        """Show a control's outcome on the status line for SAY_S at least (and keep it for tests and the log)."""
        self.said_at = time.monotonic()
        self.control_log.append(text)
        self.query_one("#status-line", Static).update(text)

    def _send(self, what: str, call: Callable[[], str]) -> None:
        """Run one control request in a thread (it waits on the network), then poll at once."""

        def work() -> None:
            from astraflow.errors import AstraflowError

            try:
                detail = call()
                text = f"{what}: done ({detail})" if detail else f"{what}: done"
            except AstraflowError as exc:
                text = f"{what}: {exc.message}"
            self.call_from_thread(self.say, text)
            self.call_from_thread(self.action_refresh_now)

        self.run_worker(work, thread=True, group="control")

    def action_toggle_admission(self, whole_run: bool) -> None:
        """Pause admission of the shown policy (or the whole run), or resume it if paused."""
        if self._no_control():
            return
        assert self.control is not None
        key = "*" if whole_run else self.policy
        if not key:
            return
        ctl, policy = self.control, "" if whole_run else self.policy
        target = "whole run" if whole_run else f"policy {policy}"
        if key in self.snap.paused:
            self._send(f"resume {target}", lambda: ctl.resume(policy))
        else:
            self._send(f"pause {target}", lambda: ctl.pause(policy))

    def action_drain(self) -> None:
        """Drain the member under the cursor of the Members table, after a yes."""
        if self._no_control():
            return
        assert self.control is not None
        if not self.tables_ready:
            return
        table = self.query_one("#member-table", DataTable)
        if self.query_one(TabbedContent).active != "members" or table.row_count == 0:
            self.say("drain: open the Members tab [2] and put the cursor on a worker")
            return
        member = str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
        ctl = self.control

        def answered(yes: bool | None) -> None:
            if yes:
                self._send(f"drain {member}", lambda: ctl.drain(member))
            else:
                self.say(f"drain {member}: cancelled")

        self.push_screen(
            Confirm(f"Drain {member}? It gets no new tasks, finishes its leases and leaves."), answered
        )

    def action_stop_run(self) -> None:
        """Stop the run cleanly (trainers checkpoint, `up` exits 0), after a yes."""
        if self._no_control():
            return
        assert self.control is not None
        ctl = self.control

        def answered(yes: bool | None) -> None:
            if yes:
                self.stop_sent = True
                self._send("stop the run", ctl.stop)
            else:
                self.say("stop: cancelled")

        self.push_screen(
            Confirm("Stop the run? Trainers finish the step they hold, checkpoint and exit."), answered
        )
