"""Turn records (memory plans, run summaries) into tables and figures."""
