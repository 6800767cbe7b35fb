// defines: WordForms, GrammarLexicon, grammar_lexicon, append_grammar_document
// The English-like half of the synthetic corpus: a small probabilistic grammar with subject-verb
// and determiner-noun agreement, so a model has structure to learn beyond word frequencies
// ("the cat sees the dogs ." / "the cats see a dog ."). All words are lowercase ASCII; tokens are
// separated by one space and every sentence ends with " .".
#pragma once
#include <span>
#include <string>
#include <string_view>

#include "fourbit/train/sequence_rng.h"

namespace fourbit::data {

struct WordForms {
  std::string_view singular;  // nouns: "mouse"; verbs: third person singular "sees"
  std::string_view plural;    // nouns: "mice";  verbs: "see"
};

// The whole vocabulary; noun and verb forms are disjoint, so a sentence can be parsed back.
struct GrammarLexicon {
  std::span<const WordForms> nouns;
  std::span<const WordForms> verbs;
  std::span<const std::string_view> adjectives;
  std::span<const std::string_view> singular_determiners;  // "a"/"an", "this", ...
  std::span<const std::string_view> plural_determiners;    // "these", "some", ...
  std::span<const std::string_view> any_determiners;       // "the"
  std::span<const std::string_view> prepositions;
  std::span<const std::string_view> names;                 // proper nouns, singular
  std::span<const std::string_view> conjunctions;          // join two clauses
};
const GrammarLexicon& grammar_lexicon();

// One document: one to three sentences, each one clause or two joined by a conjunction.
// Sentences are separated by one space. Draws only from rng.
void append_grammar_document(SequenceRng& rng, std::string& out);

}  // namespace fourbit::data
