"""Draws the Grafana panel "Accuracy: the devices' own and held-out" from the series the
quality test scraped off /metrics after every round (the panel's two queries:
max(anchorage_round_device_accuracy) and max(anchorage_round_held_out_accuracy))."""
import csv, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import PercentFormatter

src = sys.argv[1] if len(sys.argv) > 1 else "/tmp/quality/series.csv"
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp/quality/accuracy-panel.png"
rows = list(csv.DictReader(open(src)))
t = [float(r["seconds"]) for r in rows]
rnd = [int(r["round"]) for r in rows]
dev = [float(r["device_accuracy"]) for r in rows]
held = [float(r["held_out_accuracy"]) for r in rows]

plt.style.use("dark_background")
fig, ax = plt.subplots(figsize=(10, 4.6), dpi=120)
fig.patch.set_facecolor("#181b1f"); ax.set_facecolor("#181b1f")
ax.plot(t, dev, "-o", color="#73bf69", lw=2, ms=5, label="devices' own (sample-weighted local_accuracy)")
ax.plot(t, held, "-o", color="#5794f2", lw=2, ms=5, label="held-out set ([evaluation])")
for x, r, y in zip(t, rnd, held):
    ax.annotate(f"r{r}", (x, y), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=7, color="#9fa7b3")
ax.set_ylim(0, 1.02); ax.yaxis.set_major_formatter(PercentFormatter(1.0))
ax.set_xlabel("seconds since the server was ready (one point per closed round, scraped from /metrics)", color="#9fa7b3", fontsize=9)
ax.grid(color="#2c3235", lw=0.8); ax.tick_params(colors="#9fa7b3", labelsize=8)
for s in ax.spines.values(): s.set_color("#2c3235")
ax.set_title("Accuracy: the devices' own and held-out", loc="left", fontsize=11, color="#d8d9da")
ax.legend(loc="lower right", fontsize=8, frameon=False)
fig.text(0.01, 0.01, "max(anchorage_round_device_accuracy{instance=~\"\$instance\"})   ·   "
         "max(anchorage_round_held_out_accuracy{instance=~\"\$instance\"})", fontsize=7, color="#6e7680")
fig.tight_layout(rect=(0, 0.03, 1, 1))
fig.savefig(out, facecolor=fig.get_facecolor())
print(out)
