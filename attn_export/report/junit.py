"""JUnit XML: one testcase per model x runtime (its sweep, its decode trajectories and its
generations; onnxruntime-genai's a runtime of its own), failures carrying their numbers."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import TYPE_CHECKING

from attn_export.report.base import ReportFormat

if TYPE_CHECKING:
    from attn_export.pipelines.verify import CaseResult, VerifyReport

__all__ = ["FORMAT", "junit_xml"]


def junit_xml(report: VerifyReport) -> str:
    groups: dict[tuple[str, str], list[CaseResult]] = defaultdict(list)
    for c in report.cases:
        groups[(c.model, c.runtime)].append(c)
    for d in report.decode:
        groups.setdefault((d.model, d.runtime), [])
    for g in report.generate:
        groups.setdefault((g.model, g.runner), [])
    runtimes = sorted({c.runtime for c in report.cases}) or ["checks"]
    for check in report.checks:
        for runtime in runtimes:
            groups.setdefault((check.model, runtime), [])

    suite = ET.Element("testsuite", name="attn-export verify")
    failures = 0
    for (model, runtime), cases in sorted(groups.items()):
        # No per-testcase time: only the whole run's duration is measured (on the suite).
        case_el = ET.SubElement(suite, "testcase", classname=model, name=runtime)
        problems = next((c.problems for c in report.checks if c.model == model), [])
        failing = [c for c in cases if not c.passed]
        decode = [d for d in report.decode if (d.model, d.runtime) == (model, runtime) and not d.passed]
        generate = [g for g in report.generate if (g.model, g.runner) == (model, runtime) and not g.passed]
        placement = next((p for p in report.placement if (p.model, p.runtime) == (model, runtime)), None)
        misplaced = [placement.gate] if placement is not None and placement.gate else []
        if problems or failing or decode or generate or misplaced:
            failures += 1
            lines = [*problems, *misplaced]
            for c in failing:
                lines.append(f"{c.shape} {c.sizes} seed={c.seed}: {'; '.join(c.reasons())}")
                lines.append(f"  reproduce: {report.reproduce(c)}")
            for d in decode:
                lines += [f"decode {d.scenario}: {'; '.join(d.reasons())}"]
                lines += [f"  reproduce: {report.reproduce_decode(d)}"]
            for g in generate:
                lines += [f"generate {g.layout}: {g.divergence}", f"  reproduce: {report.reproduce_generation(g)}"]
            first = lines[0]
            fail_el = ET.SubElement(case_el, "failure", message=first, type="mismatch")
            fail_el.text = "\n".join(lines)
        props = ET.SubElement(case_el, "properties")
        ET.SubElement(props, "property", name="shapes", value=str(len(cases)))
        ET.SubElement(props, "property", name="seed", value=str(report.seed))
        if placement is not None:
            ET.SubElement(props, "property", name="placement", value=placement.placement.summary())
        notes = [f"{c.shape} {c.sizes}: {n}" for c in cases for n in c.notes]
        if notes:
            ET.SubElement(case_el, "system-out").text = "\n".join(notes)
    suite.set("tests", str(len(groups)))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("time", f"{report.seconds:.3f}")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


FORMAT = ReportFormat("junit", junit_xml, "Write JUnit XML here (one testcase per model x runtime).")
