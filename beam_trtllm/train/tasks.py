"""The coding requests of the synthetic dialogues: small Python tasks, each with the words a user
asks for it in, the function (name, parameters, body) and the reasoning behind it.

Every task's code is checked with `ast.parse` when a dialogue is made (dialogues.py), so a
typo here fails the generator, never the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    phrases: tuple[str, ...]  # "adds two numbers": what the function does, third person
    names: tuple[str, ...]  # function names to pick from
    params: tuple[tuple[str, ...], ...]  # alternative parameter lists
    body: str  # the body, indented 4, may use {0}, {1}, ... for the parameters
    plan: str  # one sentence of reasoning about how
    returns: str  # what it returns, for the explanation
    hints: tuple[str, ...] = ()  # type hints of the parameters, in order ("" for none)
    result_hint: str = ""


def _t(phrases, names, params, body, plan, returns, hints=(), result_hint=""):
    return Task(tuple(phrases), tuple(names), tuple(tuple(p) for p in params), body, plan,
                returns, tuple(hints), result_hint)


TASKS: tuple[Task, ...] = (
    _t(["adds two numbers", "returns the sum of two numbers", "adds two values together"],
       ["add", "add_numbers", "sum_two"], [["a", "b"], ["x", "y"], ["first", "second"]],
       "    return {0} + {1}", "Adding is a single expression, so the body is one return.",
       "the sum of the two arguments", ["float", "float"], "float"),
    _t(["subtracts one number from another", "returns the difference of two numbers"],
       ["subtract", "difference"], [["a", "b"], ["x", "y"]],
       "    return {0} - {1}", "The difference is the first value minus the second.",
       "the first argument minus the second", ["float", "float"], "float"),
    _t(["multiplies two numbers", "returns the product of two numbers"],
       ["multiply", "product"], [["a", "b"], ["x", "y"]],
       "    return {0} * {1}", "Multiplication is one expression.",
       "the product of the two arguments", ["float", "float"], "float"),
    _t(["divides two numbers safely", "divides a by b and handles division by zero"],
       ["safe_divide", "divide"], [["a", "b"], ["numerator", "denominator"]],
       "    if {1} == 0:\n        return None\n    return {0} / {1}",
       "Division by zero must not raise, so I check the divisor first and return None.",
       "the quotient, or None when the divisor is zero", ["float", "float"], "float | None"),
    _t(["returns the largest number in a list", "finds the maximum of a list"],
       ["find_max", "largest"], [["numbers"], ["values"], ["items"]],
       "    best = {0}[0]\n    for value in {0}[1:]:\n        if value > best:\n"
       "            best = value\n    return best",
       "I keep the best value seen so far and compare each element with it.",
       "the largest element (the list must not be empty)", ["list[float]"], "float"),
    _t(["returns the smallest number in a list", "finds the minimum of a list"],
       ["find_min", "smallest"], [["numbers"], ["values"]],
       "    return min({0})", "The builtin min already does this.",
       "the smallest element", ["list[float]"], "float"),
    _t(["reverses a string", "returns a string backwards"],
       ["reverse_string", "reverse"], [["text"], ["s"], ["word"]],
       "    return {0}[::-1]", "A slice with step -1 walks the string from the end.",
       "the reversed string", ["str"], "str"),
    _t(["checks whether a number is even", "tells if an integer is even"],
       ["is_even"], [["n"], ["number"], ["value"]],
       "    return {0} % 2 == 0", "A number is even when dividing by two leaves no remainder.",
       "True for even numbers, False otherwise", ["int"], "bool"),
    _t(["computes the factorial of a number", "returns n factorial"],
       ["factorial"], [["n"], ["number"]],
       "    result = 1\n    for i in range(2, {0} + 1):\n        result *= i\n    return result",
       "A loop that multiplies 2..n avoids recursion limits.",
       "n! (1 for 0 and 1)", ["int"], "int"),
    _t(["returns the n-th Fibonacci number", "computes Fibonacci numbers"],
       ["fibonacci", "fib"], [["n"], ["index"]],
       "    a, b = 0, 1\n    for _ in range({0}):\n        a, b = b, a + b\n    return a",
       "Two running values are enough; each step shifts them forward.",
       "the n-th Fibonacci number, starting from fib(0) = 0", ["int"], "int"),
    _t(["counts the vowels in a string", "returns how many vowels a text has"],
       ["count_vowels"], [["text"], ["s"]],
       "    return sum(1 for ch in {0}.lower() if ch in \"aeiou\")",
       "I lower-case the text and count characters that are vowels.",
       "the number of vowels", ["str"], "int"),
    _t(["checks whether a string is a palindrome", "tells if a word reads the same backwards"],
       ["is_palindrome"], [["text"], ["word"], ["s"]],
       "    cleaned = \"\".join(ch.lower() for ch in {0} if ch.isalnum())\n"
       "    return cleaned == cleaned[::-1]",
       "I drop punctuation and case, then compare the text with its reverse.",
       "True when the text is a palindrome", ["str"], "bool"),
    _t(["converts Celsius to Fahrenheit", "turns a temperature in Celsius into Fahrenheit"],
       ["celsius_to_fahrenheit", "to_fahrenheit"], [["celsius"], ["degrees"], ["c"]],
       "    return {0} * 9 / 5 + 32", "The formula is F = C * 9/5 + 32.",
       "the temperature in Fahrenheit", ["float"], "float"),
    _t(["converts Fahrenheit to Celsius", "turns a temperature in Fahrenheit into Celsius"],
       ["fahrenheit_to_celsius", "to_celsius"], [["fahrenheit"], ["degrees"], ["f"]],
       "    return ({0} - 32) * 5 / 9", "The formula is C = (F - 32) * 5/9.",
       "the temperature in Celsius", ["float"], "float"),
    _t(["sums a list of numbers", "returns the total of a list"],
       ["sum_list", "total"], [["numbers"], ["values"]],
       "    total = 0\n    for value in {0}:\n        total += value\n    return total",
       "I add every element to a running total.",
       "the sum of the elements (0 for an empty list)", ["list[float]"], "float"),
    _t(["computes the average of a list of numbers", "returns the mean of a list"],
       ["average", "mean"], [["numbers"], ["values"]],
       "    if not {0}:\n        return 0.0\n    return sum({0}) / len({0})",
       "The mean is the sum divided by the count; an empty list would divide by zero.",
       "the mean, or 0.0 for an empty list", ["list[float]"], "float"),
    _t(["squares a number", "returns the square of a number"],
       ["square"], [["x"], ["n"], ["value"]],
       "    return {0} * {0}", "Squaring is multiplying the value by itself.",
       "the argument squared", ["float"], "float"),
    _t(["counts the words in a sentence", "returns the number of words in a text"],
       ["count_words", "word_count"], [["text"], ["sentence"]],
       "    return len({0}.split())", "str.split without arguments splits on any whitespace.",
       "the number of words", ["str"], "int"),
    _t(["removes duplicates from a list while keeping the order",
        "returns the unique items of a list in order"],
       ["unique", "dedupe"], [["items"], ["values"]],
       "    seen = set()\n    result = []\n    for item in {0}:\n        if item not in seen:\n"
       "            seen.add(item)\n            result.append(item)\n    return result",
       "A set remembers what was seen; a list keeps the first occurrence of each item.",
       "a new list without duplicates", ["list"], "list"),
    _t(["flattens a list of lists", "turns a nested list into a flat list"],
       ["flatten"], [["nested"], ["lists"]],
       "    return [item for sub in {0} for item in sub]",
       "A nested comprehension visits every inner item in order.",
       "one flat list", ["list[list]"], "list"),
    _t(["checks whether a number is prime", "tells if an integer is a prime number"],
       ["is_prime"], [["n"], ["number"]],
       "    if {0} < 2:\n        return False\n    i = 2\n    while i * i <= {0}:\n"
       "        if {0} % i == 0:\n            return False\n        i += 1\n    return True",
       "Trial division up to the square root is enough.",
       "True for primes", ["int"], "bool"),
    _t(["returns the length of the longest word in a sentence",
        "finds how long the longest word is"],
       ["longest_word_length"], [["sentence"], ["text"]],
       "    words = {0}.split()\n    if not words:\n        return 0\n"
       "    return max(len(word) for word in words)",
       "I split into words and take the largest length, with 0 for no words.",
       "the length of the longest word", ["str"], "int"),
    _t(["counts how often each character appears in a string",
        "returns a dictionary of character counts"],
       ["char_counts", "count_chars"], [["text"], ["s"]],
       "    counts = {{}}\n    for ch in {0}:\n        counts[ch] = counts.get(ch, 0) + 1\n"
       "    return counts",
       "A dictionary maps each character to how often it was seen.",
       "a dict from character to count", ["str"], "dict[str, int]"),
    _t(["capitalizes the first letter of every word", "title-cases a sentence"],
       ["capitalize_words"], [["text"], ["sentence"]],
       "    return \" \".join(word[:1].upper() + word[1:] for word in {0}.split())",
       "Each word gets its first character upper-cased, then the words are joined again.",
       "the sentence with capitalized words", ["str"], "str"),
    _t(["returns the absolute value of a number", "computes the absolute value"],
       ["absolute", "abs_value"], [["x"], ["n"]],
       "    return -{0} if {0} < 0 else {0}", "Negative values are negated, others kept.",
       "the absolute value", ["float"], "float"),
    _t(["merges two dictionaries", "combines two dicts into one"],
       ["merge_dicts"], [["a", "b"], ["first", "second"]],
       "    merged = dict({0})\n    merged.update({1})\n    return merged",
       "I copy the first dict so the input is not changed, then update it with the second.",
       "a new dict; keys of the second win", ["dict", "dict"], "dict"),
    _t(["filters the even numbers out of a list", "returns only the even numbers of a list"],
       ["even_numbers", "filter_even"], [["numbers"], ["values"]],
       "    return [n for n in {0} if n % 2 == 0]", "A comprehension keeps the even values.",
       "a list of the even numbers", ["list[int]"], "list[int]"),
    _t(["computes the greatest common divisor of two integers", "returns the gcd of two numbers"],
       ["gcd"], [["a", "b"], ["x", "y"]],
       "    while {1}:\n        {0}, {1} = {1}, {0} % {1}\n    return abs({0})",
       "Euclid's algorithm replaces the pair by (b, a mod b) until b is zero.",
       "the greatest common divisor", ["int", "int"], "int"),
    _t(["repeats a string n times with a separator", "joins n copies of a string"],
       ["repeat_text"], [["text", "n"], ["s", "times"]],
       "    return \" \".join([{0}] * {1})", "A list of n copies joined by spaces does it.",
       "the repeated text", ["str", "int"], "str"),
    _t(["clamps a number between a lower and an upper bound", "limits a value to a range"],
       ["clamp"], [["value", "low", "high"], ["x", "lo", "hi"]],
       "    return max({1}, min({0}, {2}))", "min caps the value at the top, max at the bottom.",
       "the value limited to the range", ["float", "float", "float"], "float"),
)

REQUEST_FORMS = (
    "Write a function that {phrase}.",
    "Write a Python function that {phrase}.",
    "Can you write a function that {phrase}?",
    "Please write a function that {phrase}.",
    "I need a Python function that {phrase}.",
    "Implement a function that {phrase}.",
    "Write a function that {phrase}. Keep it short.",
    "Could you give me a Python function which {phrase}?",
    "write a function that {phrase}",
    "Show me a function that {phrase}.",
)

SYSTEM_PROMPTS = (
    "You are a helpful coding assistant.",
    "You are Beam, an assistant for programming tasks.",
    "Answer briefly and write correct Python.",
    "You are a helpful assistant.",
)
