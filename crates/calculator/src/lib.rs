//! verl-calculator: the calculator's arithmetic. An expression's value is exact: integers and
//! decimals are exact rationals (`0.1 + 0.2` is `0.3`, `4821 + 3977` is `8798`); operators as in
//! Python: `+ - * / // % **`, parentheses, unary minus (`-2 ** 2` is `-4`, `**` is
//! right-associative, `%` and `//` floor towards minus infinity). A fractional power (`2 ** 0.5`)
//! leaves the exact numbers for a float. Results beyond 38 digits are refused, not approximated.
//!
//! Shared by the `calculator` tool of the `tools` plugin (which answers with [`evaluate`]'s text)
//! and `verl data gsm8k --tools calculator` (which checks GSM8K's annotations against
//! [`value_of`]). It must not know about the plugin ABI or tool calls, and must never link
//! libtorch.

use std::fmt;

/// Why an expression has no value; the message is what the model reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CalcError(pub String);

fn fail<T>(message: impl Into<String>) -> Result<T, CalcError> {
    Err(CalcError(message.into()))
}

const TOO_LARGE: &str = "result too large (the calculator works to 38 digits)";
const MAX_CHARS: usize = 10_000;
const MAX_DEPTH: usize = 200;

/// The value of `expression`, printed: an exact integer without a decimal point, an exact
/// decimal in full, anything else as the shortest float that reads back the same.
pub fn evaluate(expression: &str) -> Result<String, CalcError> {
    value_of(expression).map(|v| v.to_string())
}

/// The value of `expression`, unprinted (its `Display` is [`evaluate`]'s text).
pub fn value_of(expression: &str) -> Result<Number, CalcError> {
    if expression.chars().count() > MAX_CHARS {
        return fail(format!(
            "expression too long (more than {MAX_CHARS} characters)"
        ));
    }
    let tokens = tokenize(expression)?;
    if tokens.is_empty() {
        return fail("empty expression");
    }
    let mut p = Parser {
        tokens,
        pos: 0,
        depth: 0,
    };
    let value = p.sum()?;
    if let Some(t) = p.tokens.get(p.pos) {
        return fail(format!(
            "unexpected `{}` at character {}",
            t.kind.text(),
            t.at
        ));
    }
    Ok(Number(value))
}

/// A calculator value: an exact rational, or a float after a fractional power. Equal values
/// compare equal (exact ones are kept reduced).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Number(Num);

impl Number {
    /// The number a decimal literal as the calculator reads one denotes (`24`, `0.2`, `.5`,
    /// `5.`), with an optional leading `-` (`-3`); `None` for anything else, a literal of more
    /// than 38 digits included.
    pub fn parse_decimal(text: &str) -> Option<Number> {
        let (negative, body) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        if !body.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            return None;
        }
        let n = Num::parse(body, 1).ok()?;
        if negative {
            n.neg().ok().map(Number)
        } else {
            Some(Number(n))
        }
    }

    /// The exact value as `(numerator, denominator)`, reduced, the denominator positive; `None`
    /// for a float.
    pub fn fraction(self) -> Option<(i128, i128)> {
        match self.0 {
            Num::Exact { num, den } => Some((num, den)),
            Num::Float(_) => None,
        }
    }

    /// The exact value written out as an integer or a decimal in full (the calculator's text for
    /// it); `None` for a float or a decimal that does not end (`1 / 3`).
    pub fn exact_text(self) -> Option<String> {
        match self.0 {
            Num::Exact { num, den: 1 } => Some(num.to_string()),
            Num::Exact { num, den } => exact_decimal(num, den),
            Num::Float(_) => None,
        }
    }
}

impl fmt::Display for Number {
    /// The calculator's text: an exact integer without a decimal point, an exact decimal in full,
    /// anything else as the shortest float that reads back the same.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.display())
    }
}

// ---------------------------------------------------------------------------------------------
// Tokens and grammar:
//   sum     := product (('+' | '-') product)*
//   product := unary (('*' | '/' | '//' | '%') unary)*
//   unary   := ('-' | '+') unary | power
//   power   := atom ('**' unary)?
//   atom    := number | '(' sum ')'

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Number(String),
    Plus,
    Minus,
    Star,
    Slash,
    SlashSlash,
    Percent,
    Pow,
    Open,
    Close,
}

impl Kind {
    fn text(&self) -> &str {
        match self {
            Kind::Number(s) => s,
            Kind::Plus => "+",
            Kind::Minus => "-",
            Kind::Star => "*",
            Kind::Slash => "/",
            Kind::SlashSlash => "//",
            Kind::Percent => "%",
            Kind::Pow => "**",
            Kind::Open => "(",
            Kind::Close => ")",
        }
    }
}

#[derive(Debug, Clone)]
struct Token {
    kind: Kind,
    /// 1-based character position, for messages.
    at: usize,
}

fn tokenize(s: &str) -> Result<Vec<Token>, CalcError> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let at = i + 1;
        let two = |next: char| chars.get(i + 1) == Some(&next);
        let (kind, len) = match c {
            c if c.is_whitespace() => {
                i += 1;
                continue;
            }
            '0'..='9' | '.' => {
                let end = (i..chars.len())
                    .find(|&j| !(chars[j].is_ascii_digit() || chars[j] == '.'))
                    .unwrap_or(chars.len());
                let text: String = chars[i..end].iter().collect();
                (Kind::Number(text), end - i)
            }
            '+' => (Kind::Plus, 1),
            '-' => (Kind::Minus, 1),
            '*' if two('*') => (Kind::Pow, 2),
            '*' => (Kind::Star, 1),
            '/' if two('/') => (Kind::SlashSlash, 2),
            '/' => (Kind::Slash, 1),
            '%' => (Kind::Percent, 1),
            '(' => (Kind::Open, 1),
            ')' => (Kind::Close, 1),
            '^' => {
                return fail(format!(
                    "unexpected `^` at character {at}: write powers as `**` (2 ** 3)"
                ))
            }
            other => {
                return fail(format!(
                    "unexpected `{other}` at character {at}: an expression has numbers, \
                     + - * / // % ** and parentheses"
                ))
            }
        };
        out.push(Token { kind, at });
        i += len;
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Kind> {
        self.tokens.get(self.pos).map(|t| &t.kind)
    }

    fn sum(&mut self) -> Result<Num, CalcError> {
        let mut acc = self.product()?;
        while let Some(op @ (Kind::Plus | Kind::Minus)) = self.peek().cloned() {
            self.pos += 1;
            let rhs = self.product()?;
            acc = match op {
                Kind::Plus => acc.add(rhs)?,
                _ => acc.add(rhs.neg()?)?,
            };
        }
        Ok(acc)
    }

    fn product(&mut self) -> Result<Num, CalcError> {
        let mut acc = self.unary()?;
        while let Some(op @ (Kind::Star | Kind::Slash | Kind::SlashSlash | Kind::Percent)) =
            self.peek().cloned()
        {
            self.pos += 1;
            let rhs = self.unary()?;
            acc = match op {
                Kind::Star => acc.mul(rhs)?,
                Kind::Slash => acc.div(rhs)?,
                Kind::SlashSlash => acc.floor_div(rhs)?,
                _ => acc.rem(rhs)?,
            };
        }
        Ok(acc)
    }

    fn unary(&mut self) -> Result<Num, CalcError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return fail(format!("expression nested too deeply (over {MAX_DEPTH})"));
        }
        let v = match self.peek() {
            Some(Kind::Minus) => {
                self.pos += 1;
                self.unary()?.neg()
            }
            Some(Kind::Plus) => {
                self.pos += 1;
                self.unary()
            }
            _ => self.power(),
        };
        self.depth -= 1;
        v
    }

    fn power(&mut self) -> Result<Num, CalcError> {
        let base = self.atom()?;
        if self.peek() == Some(&Kind::Pow) {
            self.pos += 1;
            let exponent = self.unary()?;
            return base.pow(exponent);
        }
        Ok(base)
    }

    fn atom(&mut self) -> Result<Num, CalcError> {
        let Some(t) = self.tokens.get(self.pos).cloned() else {
            return fail("the expression ends where a number was expected");
        };
        self.pos += 1;
        match t.kind {
            Kind::Number(text) => Num::parse(&text, t.at),
            Kind::Open => {
                let v = self.sum()?;
                match self.peek() {
                    Some(Kind::Close) => {
                        self.pos += 1;
                        Ok(v)
                    }
                    Some(other) => fail(format!(
                        "unexpected `{}` at character {}",
                        other.text(),
                        self.tokens[self.pos].at
                    )),
                    None => fail(format!("missing `)` for the `(` at character {}", t.at)),
                }
            }
            other => fail(format!(
                "unexpected `{}` at character {}",
                other.text(),
                t.at
            )),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Numbers.

/// An exact rational (reduced, `den > 0`) or a float (after a fractional power).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Num {
    Exact { num: i128, den: i128 },
    Float(f64),
}

fn gcd(mut a: i128, mut b: i128) -> i128 {
    a = a.abs();
    b = b.abs();
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn checked(v: Option<i128>) -> Result<i128, CalcError> {
    v.ok_or_else(|| CalcError(TOO_LARGE.into()))
}

impl Num {
    fn exact(num: i128, den: i128) -> Result<Num, CalcError> {
        if den == 0 {
            return fail("division by zero");
        }
        // Bounds keep `abs` and negation of both parts from overflowing.
        if num == i128::MIN || den == i128::MIN {
            return fail(TOO_LARGE);
        }
        let g = gcd(num, den).max(1);
        let (mut num, mut den) = (num / g, den / g);
        if den < 0 {
            (num, den) = (-num, -den);
        }
        Ok(Num::Exact { num, den })
    }

    fn parse(text: &str, at: usize) -> Result<Num, CalcError> {
        let bad = || CalcError(format!("`{text}` at character {at} is not a number"));
        let (int, frac) = match text.split_once('.') {
            Some((i, f)) if !f.contains('.') => (i, f),
            Some(_) => return Err(bad()),
            None => (text, ""),
        };
        if int.is_empty() && frac.is_empty() {
            return Err(bad());
        }
        if int.len() + frac.len() > 38 {
            return fail(format!(
                "`{text}` at character {at} has too many digits (at most 38)"
            ));
        }
        let digits = format!("{int}{frac}");
        let num: i128 = digits.parse().map_err(|_| bad())?;
        Num::exact(num, 10i128.pow(frac.len() as u32))
    }

    fn as_f64(self) -> f64 {
        match self {
            Num::Exact { num, den } => num as f64 / den as f64,
            Num::Float(f) => f,
        }
    }

    fn float(v: f64) -> Result<Num, CalcError> {
        if v.is_finite() {
            Ok(Num::Float(v))
        } else {
            fail(TOO_LARGE)
        }
    }

    fn neg(self) -> Result<Num, CalcError> {
        match self {
            Num::Exact { num, den } => Num::exact(checked(num.checked_neg())?, den),
            Num::Float(f) => Ok(Num::Float(-f)),
        }
    }

    fn add(self, rhs: Num) -> Result<Num, CalcError> {
        match (self, rhs) {
            (Num::Exact { num: a, den: b }, Num::Exact { num: c, den: d }) => {
                let g = gcd(b, d);
                let left = checked(a.checked_mul(d / g))?;
                let right = checked(c.checked_mul(b / g))?;
                Num::exact(
                    checked(left.checked_add(right))?,
                    checked((b / g).checked_mul(d))?,
                )
            }
            _ => Num::float(self.as_f64() + rhs.as_f64()),
        }
    }

    fn mul(self, rhs: Num) -> Result<Num, CalcError> {
        match (self, rhs) {
            (Num::Exact { num: a, den: b }, Num::Exact { num: c, den: d }) => {
                let (g1, g2) = (gcd(a, d).max(1), gcd(c, b).max(1));
                Num::exact(
                    checked((a / g1).checked_mul(c / g2))?,
                    checked((b / g2).checked_mul(d / g1))?,
                )
            }
            _ => Num::float(self.as_f64() * rhs.as_f64()),
        }
    }

    fn is_zero(self) -> bool {
        match self {
            Num::Exact { num, .. } => num == 0,
            Num::Float(f) => f == 0.0,
        }
    }

    fn div(self, rhs: Num) -> Result<Num, CalcError> {
        if rhs.is_zero() {
            return fail("division by zero");
        }
        match rhs {
            Num::Exact { num, den } => self.mul(Num::exact(den, num)?),
            Num::Float(f) => Num::float(self.as_f64() / f),
        }
    }

    /// Python's `//`: the floor of the quotient.
    fn floor_div(self, rhs: Num) -> Result<Num, CalcError> {
        match self.div(rhs)? {
            Num::Exact { num, den } => Num::exact(num.div_euclid(den), 1),
            Num::Float(f) => Num::float(f.floor()),
        }
    }

    /// Python's `%`: `x - y * floor(x / y)`, so the result has the sign of `y`.
    fn rem(self, rhs: Num) -> Result<Num, CalcError> {
        if rhs.is_zero() {
            return fail("division by zero (modulo by zero)");
        }
        match (self, rhs) {
            (Num::Exact { .. }, Num::Exact { .. }) => {
                let q = self.floor_div(rhs)?;
                self.add(rhs.mul(q)?.neg()?)
            }
            _ => {
                let (x, y) = (self.as_f64(), rhs.as_f64());
                let r = x % y;
                Num::float(if r != 0.0 && (r < 0.0) != (y < 0.0) {
                    r + y
                } else {
                    r
                })
            }
        }
    }

    fn pow(self, exponent: Num) -> Result<Num, CalcError> {
        if let (Num::Exact { num, den }, Num::Exact { num: e, den: 1 }) = (self, exponent) {
            if num == 0 {
                return match e {
                    e if e < 0 => fail("0 cannot be raised to a negative power"),
                    0 => Num::exact(1, 1),
                    _ => Num::exact(0, 1),
                };
            }
            let magnitude = e.unsigned_abs();
            let (mut n, mut d) = (checked_pow(num, magnitude)?, checked_pow(den, magnitude)?);
            if e < 0 {
                (n, d) = (d, n);
            }
            return Num::exact(n, d);
        }
        let (b, e) = (self.as_f64(), exponent.as_f64());
        if b < 0.0 && e.fract() != 0.0 {
            return fail(format!(
                "a negative number cannot be raised to a fractional power ({} ** {})",
                self.display(),
                exponent.display()
            ));
        }
        if b == 0.0 && e < 0.0 {
            return fail("0 cannot be raised to a negative power");
        }
        Num::float(b.powf(e))
    }

    fn display(self) -> String {
        match self {
            Num::Exact { num, den: 1 } => num.to_string(),
            Num::Exact { num, den } => {
                exact_decimal(num, den).unwrap_or_else(|| float_text(num as f64 / den as f64))
            }
            Num::Float(f) => float_text(f),
        }
    }
}

/// `base ** e` in exact integers; an overflow is a refused result (the exponent never needs
/// more than 127 squarings before that).
fn checked_pow(base: i128, e: u128) -> Result<i128, CalcError> {
    if base == 1 {
        return Ok(1);
    }
    if base == -1 {
        return Ok(if e % 2 == 0 { 1 } else { -1 });
    }
    if e > 127 {
        return fail(format!("{TOO_LARGE}: exponent {e}"));
    }
    checked(base.checked_pow(e as u32))
}

/// `num / den` written out in full when the denominator divides a power of ten.
fn exact_decimal(num: i128, den: i128) -> Option<String> {
    let mut d = den;
    let (mut twos, mut fives) = (0u32, 0u32);
    while d % 2 == 0 {
        d /= 2;
        twos += 1;
    }
    while d % 5 == 0 {
        d /= 5;
        fives += 1;
    }
    if d != 1 {
        return None;
    }
    let places = twos.max(fives);
    let scaled = num.checked_mul(10i128.checked_pow(places)? / den)?;
    let digits = scaled.unsigned_abs().to_string();
    let digits = format!("{digits:0>width$}", width = places as usize + 1);
    let (int, frac) = digits.split_at(digits.len() - places as usize);
    let sign = if scaled < 0 { "-" } else { "" };
    Some(format!("{sign}{int}.{frac}"))
}

/// A float as the model should read it: a whole number without a decimal point, else the
/// shortest text that reads back as the same float.
fn float_text(f: f64) -> String {
    if f == 0.0 {
        return "0".into();
    }
    if f.fract() == 0.0 && f.abs() < 1e16 {
        return format!("{}", f as i64);
    }
    if f.abs() >= 1e16 || f.abs() < 1e-6 {
        return format!("{f:e}");
    }
    format!("{f}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(e: &str) -> String {
        evaluate(e).unwrap_or_else(|err| panic!("{e}: {}", err.0))
    }
    fn err(e: &str) -> String {
        evaluate(e).expect_err(e).0
    }

    #[test]
    fn the_quickstart_sum_is_exactly_8798() {
        assert_eq!(ok("4821 + 3977"), "8798");
    }

    #[test]
    fn precedence_and_associativity_follow_python() {
        assert_eq!(ok("2 + 3 * 4"), "14");
        assert_eq!(ok("(2 + 3) * 4"), "20");
        assert_eq!(ok("10 - 4 - 3"), "3");
        assert_eq!(ok("2 ** 3 ** 2"), "512");
        assert_eq!(ok("-2 ** 2"), "-4");
        assert_eq!(ok("(-2) ** 2"), "4");
        assert_eq!(ok("2 ** -1"), "0.5");
        assert_eq!(ok("--3"), "3");
        assert_eq!(ok("+3 - -3"), "6");
        assert_eq!(ok("100 / 10 / 5"), "2");
    }

    #[test]
    fn integers_and_decimals_are_exact() {
        assert_eq!(ok("0.1 + 0.2"), "0.3");
        assert_eq!(ok("7 / 2"), "3.5");
        assert_eq!(ok("10 / 4"), "2.5");
        assert_eq!(ok("10 / 2"), "5");
        assert_eq!(ok("2.5 * 4"), "10");
        assert_eq!(ok("1 / 1024"), "0.0009765625");
        assert_eq!(ok("-3 / 8"), "-0.375");
        assert_eq!(ok(".5 + 5."), "5.5");
        assert_eq!(ok("1 / 3"), "0.3333333333333333");
        assert_eq!(ok("123456789 * 987654321"), "121932631112635269");
        assert_eq!(ok("2 ** 100"), "1267650600228229401496703205376");
    }

    #[test]
    fn modulo_and_floor_division_take_the_sign_of_the_divisor() {
        assert_eq!(ok("17 % 5"), "2");
        assert_eq!(ok("-7 % 3"), "2");
        assert_eq!(ok("7 % -3"), "-2");
        assert_eq!(ok("7.5 % 2"), "1.5");
        assert_eq!(ok("-7 // 2"), "-4");
        assert_eq!(ok("7 // 2"), "3");
    }

    #[test]
    fn fractional_powers_become_floats() {
        assert_eq!(ok("2 ** 0.5"), "1.4142135623730951");
        assert_eq!(ok("4 ** 0.5"), "2");
        assert_eq!(ok("0 ** 0"), "1");
    }

    #[test]
    fn errors_say_what_is_wrong_and_where() {
        assert_eq!(err("1 / 0"), "division by zero");
        assert_eq!(err("1 / (2 - 2)"), "division by zero");
        assert!(err("5 % 0").starts_with("division by zero"));
        assert_eq!(err("0 ** -1"), "0 cannot be raised to a negative power");
        assert_eq!(err(""), "empty expression");
        assert_eq!(err("   "), "empty expression");
        assert_eq!(err("2 +* 3"), "unexpected `*` at character 4");
        assert_eq!(err("(1 + 2"), "missing `)` for the `(` at character 1");
        assert_eq!(err("1 + 2)"), "unexpected `)` at character 6");
        assert_eq!(
            err("1 +"),
            "the expression ends where a number was expected"
        );
        assert_eq!(err("1.2.3"), "`1.2.3` at character 1 is not a number");
        assert!(err("2 ^ 3").contains("write powers as `**`"));
        assert!(err("x + 1").starts_with("unexpected `x` at character 1"));
        assert!(err("1,000 + 1").starts_with("unexpected `,` at character 2"));
        assert!(err("(-8) ** 0.5").contains("negative number cannot be raised to a fractional"));
    }

    #[test]
    fn absurdly_large_results_and_exponents_are_refused() {
        assert!(err("2 ** 200").starts_with("result too large"));
        assert!(err("10 ** 10 ** 10").starts_with("result too large"));
        assert!(err("99999999999999999999 * 99999999999999999999").starts_with("result too large"));
        assert!(err("10.5 ** 10000.5").starts_with("result too large"));
        assert!(err(&"1".repeat(39)).contains("too many digits"));
        assert!(
            err(&format!("{}1{}", "(".repeat(300), ")".repeat(300))).contains("nested too deeply")
        );
        // A power of one or zero is cheap whatever the exponent.
        assert_eq!(ok("1 ** 100000000000"), "1");
        assert_eq!(ok("(-1) ** 100000000001"), "-1");
    }

    #[test]
    fn gsm8k_annotation_arithmetic_is_exact() {
        assert_eq!(ok("48/2"), "24");
        assert_eq!(ok("12/60"), "0.2");
        assert_eq!(ok("0.2*50"), "10");
        assert_eq!(ok("80/100*10"), "8");
        assert_eq!(ok("100 - 50 - 30 - 15"), "5");
        assert_eq!(ok(".25/.05"), "5");
        assert_eq!(ok("1.75-(-1.25)"), "3");
        assert_eq!(ok("-18/-2"), "9");
        assert_eq!(ok("71+-3"), "68");
        assert_eq!(ok("560//10"), "56");
        assert_eq!(err("1 // (2 - 2)"), "division by zero");
    }

    #[test]
    fn values_compare_exactly_and_print_as_the_calculator_answers() {
        let v = |e: &str| value_of(e).unwrap_or_else(|err| panic!("{e}: {err}"));
        let lit = Number::parse_decimal;
        assert_eq!(lit("0.2"), Some(v("12/60")));
        assert_eq!(lit("-0.375"), Some(v("-3 / 8")));
        assert_eq!(lit("5."), Some(v("5")));
        assert_eq!(lit(".5"), Some(v("1/2")));
        assert_eq!(lit("-47"), Some(v("-47")));
        assert_ne!(lit("3.33"), Some(v("10/3")));
        for not_a_literal in [
            "", "-", ".", "--5", "+5", " 5", "1,000", "1.2.3", "3/4", "2e3",
        ] {
            assert_eq!(lit(not_a_literal), None, "{not_a_literal:?}");
        }
        assert_eq!(
            lit(&"1".repeat(38)).map(|n| n.to_string()),
            Some("1".repeat(38))
        );
        assert_eq!(lit(&"1".repeat(39)), None);

        assert_eq!(v("10/4").exact_text().as_deref(), Some("2.5"));
        assert_eq!(v("-4/2").exact_text().as_deref(), Some("-2"));
        assert_eq!(v("-4/2").fraction(), Some((-2, 1)));
        assert_eq!(v("10/3").fraction(), Some((10, 3)));
        assert_eq!(v("10/3").exact_text(), None);
        assert_eq!(v("10/3").to_string(), "3.3333333333333335");
        assert_eq!(v("2 ** 0.5").fraction(), None);
        assert_eq!(v("2 ** 0.5").exact_text(), None);
        assert_eq!(v("2 ** 0.5").to_string(), evaluate("2 ** 0.5").unwrap());
    }
}
