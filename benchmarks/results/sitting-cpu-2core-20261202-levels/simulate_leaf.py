import os, sys, json
if os.environ.get("NOLEAF"):
    from kvcm_core.cache_publish import PublishMixin
    PublishMixin._demote_leaf = lambda self: None
from kvcm_core.cli import main
out = sys.argv[1]
rc = main(["simulate", "--no-plots", "--quiet", "--no-compare", "--out", out] + sys.argv[2:])
r = json.load(open(os.path.join(out, "report.json")))
print(rc, {k: v for k, v in r.items() if "hit" in k.lower()} if isinstance(r, dict) else r)
