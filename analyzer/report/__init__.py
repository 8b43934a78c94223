"""Reports of a verdict (text, Markdown, HTML, JSON) and the standalone repro of its culprit."""
