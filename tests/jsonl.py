"""Batch input and output files for tests: JSONL lines written and read, a chat completions batch line."""
import json


def write_jsonl(path, rows):
    """Each row a line: a dict as JSON, a string as given (a bad line on purpose)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def chat(cid, content, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], **body}}
