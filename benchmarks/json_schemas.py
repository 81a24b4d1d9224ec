"""(prompt, JSON schema) pairs for structured outputs: the e2e test's 50 generations and the masking benchmark."""

from __future__ import annotations

# Bounded strings, enums, integer ranges, arrays, nested objects, patterns: each finishes well within
# 256 tokens on the default model (the longest seen is ~120), so one that does not parse is the grammar's fault.
SCHEMAS = [
    ("Describe a person.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 120}}}),
    ("Describe a city.", {
        "type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                       "population": {"type": "integer", "minimum": 0, "maximum": 100000000}}}),
    ("Describe a book.", {
        "type": "object", "additionalProperties": False, "required": ["title", "tags", "in_print"],
        "properties": {"title": {"type": "string", "maxLength": 32}, "in_print": {"type": "boolean"},
                       "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"enum": ["fiction", "science", "history", "poetry"]}}}}),
    ("Rate this review: 'I loved it'.", {
        "type": "object", "additionalProperties": False, "required": ["sentiment", "confidence"],
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}}),
    ("Write an order for two items.", {
        "type": "object", "additionalProperties": False, "required": ["order_id", "items", "address"],
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {"type": "array", "maxItems": 3, "items": {
                "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                "properties": {"sku": {"type": "string", "maxLength": 12},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
            "address": {"type": "object", "additionalProperties": False, "required": ["street", "zip"],
                        "properties": {"street": {"type": "string", "maxLength": 30},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}),
]
