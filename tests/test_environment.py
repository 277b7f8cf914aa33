"""What the environment `make install` builds costs at start-up.

A notebook kernel imports nbformat at its first plotly figure (plotly's renderers ask
for its version), and so does every sweep point, papermill, nbval and JupyterLab.
nbformat imports jsonschema, whose format checkers from 4.24 on import rfc3987-syntax,
which builds ~35 Earley parsers as it is imported: 1.4 s each time on this machine.
pyproject.toml keeps jsonschema below 4.24 for that; this says whether it worked.
"""

import subprocess
import sys


def test_importing_nbformat_builds_no_iri_grammar():
    code = ("import sys, nbformat, plotly.io as pio; pio.renderers; "
            "print(sorted(m for m in sys.modules if m.startswith(('rfc3987', 'lark'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"nbformat pulled in {out} (jsonschema >= 4.24? see pyproject.toml)"
