"""The profile: the document a tune writes (`profile`), the folder of them (`store`), the
frontier point that fits at start (`fitting`), exports to other trainers (`export`), and the
out-of-memory demotions recorded beside a profile (`demotions`)."""
