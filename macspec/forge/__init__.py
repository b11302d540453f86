"""Offline forge of the embedded model family: tokenizer, target, distilled draft, MTP head."""
