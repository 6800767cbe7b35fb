// defines: grammar_lexicon, append_grammar_document (grammar.h)
#include "fourbit/train/grammar.h"

#include <array>

namespace fourbit::data {
namespace {

constexpr std::array<WordForms, 40> kNouns = {{
    {"cat", "cats"},         {"dog", "dogs"},           {"bird", "birds"},
    {"fox", "foxes"},        {"horse", "horses"},       {"cow", "cows"},
    {"mouse", "mice"},       {"rabbit", "rabbits"},     {"owl", "owls"},
    {"eagle", "eagles"},     {"child", "children"},     {"man", "men"},
    {"woman", "women"},      {"teacher", "teachers"},   {"farmer", "farmers"},
    {"doctor", "doctors"},   {"king", "kings"},         {"queen", "queens"},
    {"girl", "girls"},       {"boy", "boys"},           {"baker", "bakers"},
    {"sailor", "sailors"},   {"student", "students"},   {"friend", "friends"},
    {"neighbor", "neighbors"}, {"wolf", "wolves"},      {"goose", "geese"},
    {"frog", "frogs"},       {"bear", "bears"},         {"lion", "lions"},
    {"tiger", "tigers"},     {"duck", "ducks"},         {"pig", "pigs"},
    {"goat", "goats"},       {"robot", "robots"},       {"painter", "painters"},
    {"pilot", "pilots"},     {"nurse", "nurses"},       {"artist", "artists"},
    {"monkey", "monkeys"},
}};

constexpr std::array<WordForms, 25> kVerbs = {{
    {"sees", "see"},         {"likes", "like"},         {"chases", "chase"},
    {"finds", "find"},       {"watches", "watch"},      {"helps", "help"},
    {"follows", "follow"},   {"knows", "know"},         {"wants", "want"},
    {"feeds", "feed"},       {"carries", "carry"},      {"loves", "love"},
    {"hears", "hear"},       {"calls", "call"},         {"meets", "meet"},
    {"visits", "visit"},     {"pushes", "push"},        {"catches", "catch"},
    {"holds", "hold"},       {"remembers", "remember"}, {"greets", "greet"},
    {"teaches", "teach"},    {"paints", "paint"},       {"thanks", "thank"},
    {"trusts", "trust"},
}};

constexpr std::array<std::string_view, 15> kAdjectives = {
    "big",   "small", "red",   "old",   "young",  "happy", "quiet", "green",
    "tall",  "brave", "lazy",  "clever", "angry", "little", "blue"};

// "a" is drawn; "an" is how it is spelled before a vowel.
constexpr std::array<std::string_view, 5> kSingularDeterminers = {"a", "an", "this", "that",
                                                                  "every"};
constexpr std::array<std::string_view, 6> kPluralDeterminers = {"these", "those", "some",
                                                                "many",  "two",   "three"};
constexpr std::array<std::string_view, 1> kAnyDeterminers = {"the"};
constexpr std::array<std::string_view, 6> kPrepositions = {"near", "with", "behind",
                                                           "under", "beside", "from"};
constexpr std::array<std::string_view, 10> kNames = {"alice", "bob",   "carol", "dave", "emma",
                                                     "frank", "grace", "henry", "iris", "jack"};
constexpr std::array<std::string_view, 4> kConjunctions = {"and", "but", "because", "while"};

// Probabilities of the grammar's choices; tuned by eye so documents are varied but short
// (about 40-150 bytes).
constexpr double kPluralP = 0.4;
constexpr double kTheP = 0.5;
constexpr double kAdjectiveP = 0.35;
constexpr double kSubjectNameP = 0.2;
constexpr double kObjectNameP = 0.15;
constexpr double kSubjectPrepP = 0.15;
constexpr double kClausePrepP = 0.25;
constexpr double kConjunctionP = 0.3;

template <typename T, size_t N>
const T& pick(SequenceRng& rng, const std::array<T, N>& words) {
  return words[rng.below(uint32_t(N))];
}

class SentenceWriter {
 public:
  SentenceWriter(SequenceRng& rng, std::string& out) : rng_(rng), out_(out) {}

  void document() {
    const uint32_t sentences = 1 + rng_.below(3);
    for (uint32_t s = 0; s < sentences; ++s) sentence();
  }

 private:
  // Words, and sentences, are separated by exactly one space.
  void word(std::string_view w) {
    if (!out_.empty()) out_ += ' ';
    out_ += w;
  }

  void sentence() {
    clause();
    if (rng_.chance(kConjunctionP)) {
      word(pick(rng_, kConjunctions));
      clause();
    }
    word(".");
  }

  void clause() {
    bool plural = false;
    if (rng_.chance(kSubjectNameP)) {
      word(pick(rng_, kNames));
    } else {
      plural = rng_.chance(kPluralP);
      noun_phrase(plural);
      if (rng_.chance(kSubjectPrepP)) prepositional_phrase();
    }
    const WordForms& verb = pick(rng_, kVerbs);
    word(plural ? verb.plural : verb.singular);
    if (rng_.chance(kObjectNameP))
      word(pick(rng_, kNames));
    else
      noun_phrase(rng_.chance(kPluralP));
    if (rng_.chance(kClausePrepP)) prepositional_phrase();
  }

  void prepositional_phrase() {
    word(pick(rng_, kPrepositions));
    noun_phrase(rng_.chance(kPluralP));
  }

  // Determiner [adjective] noun, the determiner agreeing with the noun's number.
  void noun_phrase(bool plural) {
    std::string_view det;
    if (rng_.chance(kTheP)) {
      det = kAnyDeterminers[0];
    } else if (plural) {
      det = pick(rng_, kPluralDeterminers);
    } else {
      constexpr std::array<std::string_view, 4> drawn = {"a", "this", "that", "every"};
      det = pick(rng_, drawn);
    }
    std::string_view adjective;
    if (rng_.chance(kAdjectiveP)) adjective = pick(rng_, kAdjectives);
    const WordForms& noun = pick(rng_, kNouns);
    const std::string_view head = plural ? noun.plural : noun.singular;
    const std::string_view next = adjective.empty() ? head : adjective;
    if (det == "a" && std::string_view("aeiou").find(next[0]) != std::string_view::npos)
      det = "an";
    word(det);
    if (!adjective.empty()) word(adjective);
    word(head);
  }

  SequenceRng& rng_;
  std::string& out_;
};

}  // namespace

const GrammarLexicon& grammar_lexicon() {
  static const GrammarLexicon lexicon{kNouns,
                                      kVerbs,
                                      kAdjectives,
                                      kSingularDeterminers,
                                      kPluralDeterminers,
                                      kAnyDeterminers,
                                      kPrepositions,
                                      kNames,
                                      kConjunctions};
  return lexicon;
}

void append_grammar_document(SequenceRng& rng, std::string& out) {
  std::string doc;
  SentenceWriter(rng, doc).document();
  out += doc;
}

}  // namespace fourbit::data
