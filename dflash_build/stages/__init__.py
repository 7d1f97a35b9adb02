"""The stages, one module each, and what they share: prepare (with readers, columnar and the filters:
words, decontaminate, neardup), generate (with chat), tokenize, mix (with crosssource), pack, export."""
