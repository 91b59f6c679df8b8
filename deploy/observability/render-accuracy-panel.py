"""Draws the Grafana panel "Accuracy: the devices' own and held-out" from the series the
quality test scraped off /metrics after every round. The panel's title, queries and legends are
read from grafana-dashboard.json; each query must be max(<series>{instance=~"$instance"}) over
one server, which is the scraped <series> itself (its CSV column: the name without
`anchorage_round_`)."""
import csv, json, os, re, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import PercentFormatter

src = sys.argv[1] if len(sys.argv) > 1 else "/tmp/quality/series.csv"
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp/quality/accuracy-panel.png"
rows = list(csv.DictReader(open(src)))
t = [float(r["seconds"]) for r in rows]
rnd = [int(r["round"]) for r in rows]
here = os.path.dirname(os.path.abspath(__file__))
dashboard = json.load(open(os.path.join(here, "grafana-dashboard.json")))
TITLE = "Accuracy: the devices' own and held-out"
panel = next(p for p in dashboard["panels"] if p["title"] == TITLE)
series = []
for target in panel["targets"]:
    m = re.fullmatch(r'max\((anchorage_round_\w+)\{instance=~"\$instance"\}\)', target["expr"])
    assert m, f"not a max over one series: {target['expr']}"
    column = m.group(1).removeprefix("anchorage_round_")
    series.append((target["legendFormat"], [float(r[column]) for r in rows], target["expr"]))
(dev_label, dev, _), (held_label, held, _) = series

plt.style.use("dark_background")
fig, ax = plt.subplots(figsize=(10, 4.6), dpi=120)
fig.patch.set_facecolor("#181b1f"); ax.set_facecolor("#181b1f")
ax.plot(t, dev, "-o", color="#73bf69", lw=2, ms=5, label=dev_label)
ax.plot(t, held, "-o", color="#5794f2", lw=2, ms=5, label=held_label)
for x, r, y in zip(t, rnd, held):
    ax.annotate(f"r{r}", (x, y), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=7, color="#9fa7b3")
ax.set_ylim(0, 1.02); ax.yaxis.set_major_formatter(PercentFormatter(1.0))
ax.set_xlabel("seconds since the server was ready (one point per closed round, scraped from /metrics)", color="#9fa7b3", fontsize=9)
ax.grid(color="#2c3235", lw=0.8); ax.tick_params(colors="#9fa7b3", labelsize=8)
for s in ax.spines.values(): s.set_color("#2c3235")
ax.set_title(panel["title"], loc="left", fontsize=11, color="#d8d9da")
ax.legend(loc="lower right", fontsize=8, frameon=False)
fig.text(0.01, 0.01, "   ·   ".join(expr.replace("$", r"\$") for _, _, expr in series), fontsize=7, color="#6e7680")
fig.tight_layout(rect=(0, 0.03, 1, 1))
fig.savefig(out, facecolor=fig.get_facecolor())
print(out)
